"""The prefix cache's offload tier end to end on the tiny model (CPU, fp32).

A prefix whose MLA blocks and KDA checkpoints the device cache evicted is served from host
memory, and after a restart from disk, with the output of a recompute; a turn-end checkpoint
inside a block comes back with its tail block's KV; a file that cannot be read is a miss (the
prompt recomputes, the output stays right); another cache layout never reads the files; every
pool ends free (the make_llm fixture checks) and the tier ends idle."""

from __future__ import annotations

import glob
import os
import random

import pytest

from kdaserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# 40 blocks of 16 tokens: six 200-token prompts evict a 260-token one; 4 checkpoint slots.
SMALL = dict(block_size=16, num_gpu_blocks=40, kda_checkpoint_interval=64,
             num_kda_checkpoint_slots=4)
HOST = 0.01   # GiB: ~2000 blocks and ~30 KDA states of the tiny model


def _prompts(seed: int = 0):
    rng = random.Random(seed)
    first = [rng.randrange(3, 128) for _ in range(260)]
    others = [[rng.randrange(3, 128) for _ in range(200)] for _ in range(6)]
    return first, others


def run_each(llm, prompts):
    """One request at a time (each sees the cache the ones before it left)."""
    out = []
    for p in prompts:
        o = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
        out.append((list(o.outputs[0].token_ids), o.num_cached_tokens))
    return out


def _stats(llm):
    return llm.llm_engine.get_stats()


def _drain(llm) -> None:
    """Let the tier's copies and file jobs finish (as the engine does at shutdown)."""
    core = llm.llm_engine.engine_core
    core._drain_offload(core.scheduler)
    assert not core.scheduler.offload.busy


def test_evicted_prefix_is_served_from_host_memory(make_llm):
    first, others = _prompts()
    again = first + [5, 6, 7]
    ref = run_each(make_llm(enable_prefix_caching=False, **SMALL), [first] + others + [again])

    no_tier = run_each(make_llm(**SMALL), [first] + others + [again])
    assert no_tier[-1][1] == 0, "the device cache alone was expected to have evicted it"

    llm = make_llm(**SMALL, kv_offload_size=HOST)
    got = run_each(llm, [first] + others + [again])
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert got[-1][1] == 256            # the deepest interval checkpoint, from host memory
    st = _stats(llm)
    assert st.offload_host_hit_tokens == 256 and st.offload_disk_hit_tokens == 0
    assert st.offload_bytes_stored > 0 and st.offload_bytes_loaded > 0
    _drain(llm)


def test_turn_end_checkpoint_inside_a_block_comes_back_with_its_tail(make_llm):
    """The next chat turn diverges where the last one finished (263 tokens, inside a block):
    the checkpoint there and its tail block's KV spill and come back together."""
    first, others = _prompts(1)
    ref_llm = make_llm(enable_prefix_caching=False, **SMALL)
    (answer, _), = run_each(ref_llm, [first])
    turn = first + answer + [9, 9, 9]
    ref = run_each(ref_llm, others + [turn])

    llm = make_llm(**SMALL, kv_offload_size=HOST)
    (got_answer, _), = run_each(llm, [first])
    got = run_each(llm, others + [turn])
    assert got_answer == answer
    assert [t for t, _ in got] == [t for t, _ in ref]
    # The first turn finished after 260 + 4 tokens; its last token was never computed.
    assert got[-1][1] == len(first) + len(answer) - 1
    assert _stats(llm).offload_host_hit_tokens == got[-1][1]
    _drain(llm)


def _spill_to_disk(make_llm, folder: str, seed: int):
    """A prompt's prefix evicted to host memory and written through to disk by an engine
    that then shuts down. Returns (the prompt again with a new suffix, the recompute's
    tokens for it, the engine kwargs of the tier)."""
    first, others = _prompts(seed)
    again = first + [5, 6, 7]
    ref = run_each(make_llm(enable_prefix_caching=False, **SMALL), [again])[0][0]
    disk = dict(kv_offload_size=HOST, kv_offload_disk_path=folder)
    llm = make_llm(**SMALL, **disk)
    run_each(llm, [first] + others)
    _drain(llm)
    st = _stats(llm)
    assert st.num_offload_disk_entries == st.num_offload_host_entries > 0
    assert st.offload_bytes_written == st.offload_disk_bytes > 0
    llm.llm_engine.engine_core.shutdown()
    return again, ref, disk


def test_prefix_is_served_from_disk_after_a_restart(make_llm, tmp_path):
    again, ref, disk = _spill_to_disk(make_llm, str(tmp_path), 2)
    restarted = make_llm(**SMALL, **disk)      # empty device and host memory
    got = run_each(restarted, [again])
    assert got == [(ref, 256)]
    st = _stats(restarted)
    assert st.offload_disk_hit_tokens == 256 and st.offload_bytes_read > 0
    _drain(restarted)

    # Another cache layout (block size) has another fingerprint: it never reads these files.
    other = make_llm(**{**SMALL, "block_size": 32}, **disk)
    assert run_each(other, [again])[0][1] == 0
    assert len(glob.glob(os.path.join(str(tmp_path), "*", "index.jsonl"))) == 2


def test_unreadable_file_is_a_miss_and_the_prompt_recomputes(make_llm, tmp_path):
    again, ref, disk = _spill_to_disk(make_llm, str(tmp_path), 3)
    for path in glob.glob(os.path.join(str(tmp_path), "*", "rank0", "state-*.bin")):
        with open(path, "r+b") as f:
            f.truncate(10)                   # every KDA checkpoint file is now too short

    restarted = make_llm(**SMALL, **disk)
    got = run_each(restarted, [again])
    assert got[0][0] == ref
    assert got[0][1] == 0                    # no checkpoint left: KV alone is a miss
    st = _stats(restarted)
    assert st.offload_failures >= 1 and st.offload_disk_hit_tokens == 0
    _drain(restarted)


@pytest.mark.parametrize("bad", [dict(kv_offload_size=-1.0),
                                 dict(kv_offload_size=1.0, enable_prefix_caching=False),
                                 dict(kv_offload_disk_path="/tmp/x"),
                                 dict(kv_offload_size=1.0, kv_offload_disk_path="/tmp/x",
                                      kv_offload_disk_size=0.0)])
def test_bad_offload_settings_are_refused_by_name(bad):
    from kdaserve.config import CacheConfig

    with pytest.raises(ValueError, match="kv_offload"):
        CacheConfig(**bad)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_batches_sharing_prefixes_under_eviction_equal_a_recompute(make_llm, spec):
    """Batches of requests on four shared prefixes through a device cache that holds about one
    of them (evictions, stores and loads among other requests' exports, preemption), with and
    without speculation; n = 2 requests among them. Greedy output equals the run without
    prefix caching; every pool ends free."""
    rng = random.Random(7)
    bases = [[rng.randrange(3, 128) for _ in range(rng.choice([70, 140, 200]))]
             for _ in range(4)]
    prompts = [rng.choice(bases) + [rng.randrange(3, 128) for _ in range(rng.randint(1, 20))]
               for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 6), ignore_eos=True,
                             n=2 if i % 7 == 3 else 1) for i in range(len(prompts))]
    extra = dict(SMALL, num_gpu_blocks=30, max_num_seqs=6, max_model_len=256,
                 speculative_config=spec)

    def run(llm):
        outs = []
        for i in range(0, len(prompts), 6):     # waves: later ones hit what earlier ones left
            batch = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + 6]],
                                 params[i:i + 6], use_tqdm=False)
            outs += [[list(c.token_ids) for c in o.outputs] for o in batch]
        return outs

    ref = run(make_llm(enable_prefix_caching=False, **extra))
    llm = make_llm(kv_offload_size=HOST, **extra)
    assert run(llm) == ref
    st = _stats(llm)
    assert st.offload_host_hit_tokens > 0 and st.offload_bytes_stored > 0
    assert st.num_preemptions > 0              # the small cache preempted a request
    _drain(llm)
