"""The exponential race (kernels/sample/race.py): interpreter checks on the CPU (race_checks.py
in a subprocess), input errors, and on the GPU the draw distribution at the model's vocabulary,
the kept set, batch invariance and a CUDA-graph replay."""

import pytest
import torch

import kernel_checks as kc
from tests.stats import chi2_pvalue

INF = float("inf")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_interpreter_checks():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("race_checks.py", timeout=300)
    assert proc.returncode == 0 and "passed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.int64)), "fp32"),
    ((torch.randn(5, 2).t(), torch.zeros(2, dtype=torch.int64)), "contiguous last dim"),
    ((torch.randn(2, 5), torch.zeros(3, dtype=torch.int64)), r"seeds .*\(3,\)"),
    ((torch.randn(2, 5), torch.zeros(2, dtype=torch.int32)), "seeds .*int32"),
    ((torch.randn(2, 5), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.float64)),
     "tau .*float64"),
    ((torch.randn(2, 0), torch.zeros(2, dtype=torch.int64)), "at least 1"),
])
def test_bad_inputs_name_the_value(args, match):
    from kdaserve.kernels.sample.race import race_sample

    with pytest.raises(ValueError, match=match):
        race_sample(*args)


VOCAB = 163840


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("with_tau", [False, True])
def test_race_distribution_gpu(with_tau):
    """20000 draws spread over a 163840-token row (the mass on 12 tokens, the rest far
    below): counts against softmax, nothing below tau drawn."""
    from kdaserve.kernels.sample.race import race_sample

    n = 20000
    row = torch.full((VOCAB,), -30.0, device="cuda")
    hot = torch.tensor([3, 999, 4096, 5000, 77777, 100000, 120001, 131071, 150000, 160000,
                        163838, 163839], device="cuda")
    row[hot] = torch.linspace(-2.0, 2.0, hot.numel(), device="cuda")
    logits = row.repeat(n, 1)
    seeds = torch.randint(0, 2**62, (n,), device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(1))
    tau = torch.full((n,), -1.0, device="cuda") if with_tau else None
    got = race_sample(logits, seeds, tau)
    kept = row >= -1.0 if with_tau else row > -INF
    probs = torch.softmax(torch.where(kept, row, -INF), 0)
    counts = torch.bincount(got, minlength=VOCAB)
    assert (counts[~kept] == 0).all()
    assert chi2_pvalue(counts, probs) > 1e-4


@pytest.mark.gpu
@gpu
def test_race_rows_independent_and_graph_gpu():
    """A row's draw is the same alone and in a batch (other split counts), and a captured
    launch replayed with new logits and seeds draws what an eager call does."""
    from kdaserve.kernels.sample.race import race_sample

    g = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(33, VOCAB, device="cuda", generator=g)
    seeds = torch.randint(0, 2**62, (33,), device="cuda", generator=g)
    tau = torch.randn(33, device="cuda", generator=g) + 2.0
    batch = race_sample(logits, seeds, tau)
    for i in (0, 5, 32):
        assert race_sample(logits[i:i + 1], seeds[i:i + 1], tau[i:i + 1]).item() == batch[i]
    graph, out = kc.capture_graph(lambda: race_sample(logits, seeds, tau))
    logits.copy_(torch.randn(33, VOCAB, device="cuda", generator=g))
    seeds.copy_(torch.randint(0, 2**62, (33,), device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, race_sample(logits, seeds, tau))
