"""The engine's sampler (:mod:`kvgen.serving.sampler`): every row's choice on the logits' device, one transfer to
the host per step, and the values the per-row path computed."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvgen.serving.sampler import prompt_logprobs, sample
from kvgen.serving.scheduler import SamplingParams, Sequence

V = 50


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (``item``, ``int()``, ``float()``)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def sequences():
    params = [SamplingParams(), SamplingParams(top_logprobs=3),
              SamplingParams(do_sample=True, seed=7, temperature=0.7, top_k=20, top_p=0.9),
              SamplingParams(frequency_penalty=2.0, presence_penalty=1.0, logit_bias={4: 30.0}, top_logprobs=1),
              SamplingParams(repetition_penalty=1.5)]
    return [Sequence(f"r{i}", [1, 2, 3], p, tokens=[1, 2, 3, 9, 9]) for i, p in enumerate(params)]


def test_a_step_reads_the_host_once_and_chooses_as_each_request_asks(monkeypatch):
    raw = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 3
    raw[3, 9], raw[3, 4] = 50.0, 20.0  # the favourite, generated twice: 50 - 2 * 2 - 1 < 20 + the bias of 30
    raw[4, 9], raw[4, 11] = 10.0, 8.0  # 10 / 1.5 < 8
    transfers = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: transfers.append(t.shape) or tolist(t))
    seqs = sequences()
    with HostReads() as reads:
        chosen = sample(seqs, raw.clone(), {})
    assert reads.reads == 0 and len(transfers) == 1

    totals = torch.logsumexp(raw, dim=-1).tolist()
    assert chosen[0][0] == int(raw[0].argmax()) and chosen[0][2] == {}
    token, logprob, top = chosen[1]
    assert token == int(raw[1].argmax()) and abs(logprob - (float(raw[1, token]) - totals[1])) < 1e-12
    assert list(top) == raw[1].topk(3).indices.tolist() and top[token] == logprob
    generator = torch.Generator().manual_seed(7)  # the seeded row draws what generate()'s warpers and seed give
    assert chosen[2][0] == int(torch.multinomial(torch.softmax(warped(raw[2]), -1), 1, generator=generator))
    assert chosen[3][0] == 4 and list(chosen[3][2]) == [9]  # the alternatives are the model's, before penalties
    assert chosen[4][0] == 11


def warped(row: torch.Tensor) -> torch.Tensor:
    from kvgen.generation.logits import temperature, top_k, top_p
    scores = row[None]
    for processor in (temperature(0.7), top_k(20), top_p(0.9)):
        scores = processor(None, scores)
    return scores


def test_prompt_logprobs_come_in_one_transfer_with_each_row_alternatives():
    raw = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    scored = prompt_logprobs(raw, [5, 6, 7], [0, 2, 1])
    totals = torch.logsumexp(raw, dim=-1).tolist()
    for i, ((logprob, top), wanted) in enumerate(zip(scored, [0, 2, 1])):
        assert abs(logprob - (float(raw[i, 5 + i]) - totals[i])) < 1e-12
        assert list(top) == raw[i].topk(wanted).indices.tolist()
