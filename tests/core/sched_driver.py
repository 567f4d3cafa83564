"""A deterministic stand-in for the model runner, to drive the real Scheduler in tests.

It keeps what a real worker keeps (per-request token ids, block table, state slot) and a fake
cache: `kv[block][offset]` holds the token id written at that position, `state[slot]` holds
(tokens folded, rolling hash). The "model" reads its context back *through the block table* and
checks it against the tokens, and checks the state slot holds exactly the computed prefix, so a
wrong block table, a missed copy, a shared block overwritten or a leaked state would all fail.
Next token = a pure function of (context, seed), so recompute after preemption must reproduce
the same output.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kdaserve.core.engine_output import EngineCoreOutput
from kdaserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kdaserve.core.scheduler import Scheduler
from kdaserve.request import Request
from kdaserve.sampling_params import SamplingParams

_MOD = (1 << 61) - 1


def fold(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % _MOD


def fold_all(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = fold(h, t)
    return h


def default_next_token(context: list[int], seed: int | None) -> int:
    """Tokens in [100, 150): a hash of the context (and the seed)."""
    h = fold_all(context)
    if seed is not None:
        h = fold(h, 7919 * (seed + 1))
    return 100 + (h >> 7) % 50


@dataclass
class _RunnerReq:
    tokens: list[int]
    block_ids: list[int]
    slot: int
    num_computed: int
    seed: int | None


@dataclass
class FakeRunner:
    block_size: int
    next_token: callable = default_next_token
    kv: dict[int, list[int | None]] = field(default_factory=dict)
    state: dict[int, tuple[int, int]] = field(default_factory=dict)
    reqs: dict[str, _RunnerReq] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    exported: list[tuple[str, int, int]] = field(default_factory=list)
    """(req_id, position, checkpoint slot) of every export done."""

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        # Copies first, in list order (the worker contract).
        for src, dst in so.block_copies:
            self.kv[dst] = list(self.kv.get(src, [None] * self.block_size))
        for c in so.state_copies:
            self.state[c.dst_slot] = self.state[c.src_slot]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, new.req_id
            if new.num_computed_tokens == 0:
                self.state[new.state_slot] = (0, 0)
            self.reqs[new.req_id] = _RunnerReq(
                tokens=new.prompt_token_ids + new.output_token_ids,
                block_ids=list(new.block_ids), slot=new.state_slot,
                num_computed=new.num_computed_tokens, seed=new.sampling_params.seed)
        cached = so.scheduled_cached_reqs
        for rid, blocks, nc in zip(cached.req_ids, cached.new_block_ids,
                                   cached.num_computed_tokens):
            r = self.reqs[rid]
            assert r.num_computed == nc, (rid, r.num_computed, nc)
            r.block_ids.extend(blocks)
        slots = [r.slot for r in self.reqs.values()]
        assert len(slots) == len(set(slots)), f"state slot shared: {slots}"

        exports: dict[str, dict[int, int]] = defaultdict(dict)
        for e in so.kda_checkpoint_exports:
            exports[e.req_id][e.num_tokens] = e.dst_slot
        out = ModelRunnerOutput()
        for rid, n in so.num_scheduled_tokens.items():
            sampled = self._run_one(rid, n, so.scheduled_spec_decode_tokens.get(rid, []),
                                    exports.get(rid, {}))
            if sampled:
                out.req_ids.append(rid)
                out.sampled_token_ids.append(sampled)
                out.logprobs.append([{t: -0.5} for t in sampled])
        return out

    def _run_one(self, rid: str, n: int, drafts: list[int],
                 exports: dict[int, int]) -> list[int]:
        r = self.reqs[rid]
        seq = r.tokens + drafts
        start = r.num_computed
        assert self.state[r.slot][0] == start, (rid, self.state[r.slot], start)
        assert 0 < n and start + n <= len(seq), (rid, start, n, len(seq))
        num, h = self.state[r.slot]
        snapshots = []
        for p in range(start, start + n):
            self._write(rid, r, p, seq[p])
            num, h = num + 1, fold(h, seq[p])
            snapshots.append((num, h))
        for pos, dst in exports.items():
            assert start < pos <= min(start + n, len(r.tokens)), (rid, pos, start, n)
            self.state[dst] = snapshots[pos - start - 1]
            self.exported.append((rid, pos, dst))
        if start + n < len(r.tokens):  # still prefilling
            self.state[r.slot] = snapshots[-1]
            r.num_computed = start + n
            return []
        assert start + n == len(seq), "drafts must be scheduled whole in this driver"
        self._check_context(rid, r)
        assert snapshots[len(r.tokens) - 1 - start] == (len(r.tokens), fold_all(r.tokens)), rid
        ctx = list(r.tokens)
        accepted = []
        target = self.next_token(ctx, r.seed)
        for d in drafts:
            if d != target:
                break
            accepted.append(d)
            ctx.append(d)
            target = self.next_token(ctx, r.seed)
        # Rejected drafts leave no trace in the state.
        self.state[r.slot] = snapshots[len(r.tokens) - 1 + len(accepted) - start]
        r.num_computed = len(r.tokens) + len(accepted)
        sampled = accepted + [target]
        r.tokens += sampled
        return sampled

    def _write(self, rid: str, r: _RunnerReq, pos: int, token: int) -> None:
        idx, off = divmod(pos, self.block_size)
        assert idx < len(r.block_ids), f"{rid}: no block for position {pos}"
        block = r.block_ids[idx]
        for other_id, other in self.reqs.items():
            assert other_id == rid or block not in other.block_ids, (
                f"{rid} writes block {block} shared with {other_id}")
        self.kv.setdefault(block, [None] * self.block_size)[off] = token

    def _check_context(self, rid: str, r: _RunnerReq) -> None:
        for p, t in enumerate(r.tokens):
            idx, off = divmod(p, self.block_size)
            got = self.kv[r.block_ids[idx]][off]
            assert got == t, f"{rid}: KV position {p} holds {got}, expected {t}"


def reference_tokens(prompt: list[int], num: int, seed: int | None = None,
                     next_token=default_next_token) -> list[int]:
    """What the fake model generates for a prompt, computed directly."""
    ctx = list(prompt)
    for _ in range(num):
        ctx.append(next_token(ctx, seed))
    return ctx[len(prompt):]


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[str, str] = field(default_factory=dict)
    stop_reason: dict[str, object] = field(default_factory=dict)
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    num_steps: int = 0


def step(sched: Scheduler, runner: FakeRunner, result: RunResult | None = None,
         drafter=None) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    ro = runner.execute(so)
    outs = sched.update_from_output(so, ro)
    if result is not None:
        result.num_steps += 1
        for o in outs:
            result.outputs.append(o)
            result.tokens[o.req_id].extend(o.new_token_ids)
            if o.finished:
                result.finish[o.req_id] = o.finish_reason
                result.stop_reason[o.req_id] = o.stop_reason
    if drafter is not None:
        sched.update_draft_token_ids(drafter(sched))
    return so, outs


def run_until_done(sched: Scheduler, runner: FakeRunner, drafter=None,
                   max_steps: int = 10_000) -> RunResult:
    result = RunResult()
    while sched.has_unfinished_requests():
        assert result.num_steps < max_steps, "scheduler made no progress"
        step(sched, runner, result, drafter)
    return result


def assert_all_free(sched: Scheduler) -> None:
    """Every block and slot back in its pool, no request state left behind."""
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_gpu_blocks, (kv.num_free_blocks, kv.num_gpu_blocks)
    assert kv.num_free_slots == kv.num_state_slots, (kv.num_free_slots, kv.num_state_slots)
    assert all(kv.block_pool.ref_count(b) == 0 for b in range(kv.num_gpu_blocks))
    assert not kv._blocks and not kv._slot and not kv._reserved_slots
    assert not sched.running and not sched.waiting and not sched.requests
    assert not sched._children and not sched._child_ids and not sched._unsent


def make_request(req_id: str, prompt_len: int, *, max_tokens: int | None = 4, start: int = 1,
                 eos: int | list[int] | None = None, **params) -> Request:
    prompt = [start + (7 * i) % 90 for i in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=eos)
