"""Choosing next tokens: greedy, sampling, and beam search (plain, grouped with a diversity penalty, sampled).

Beam search keeps, per batch item and per beam group, the ``group_size`` best running
beams and the ``group_size`` best finished hypotheses (scored ``sum log p / length **
length_penalty``). It follows transformers' beam scorer step for step (candidate
ranking, EOS handling, the three ``early_stopping`` rules, group diversity), so
sequences and scores are comparable with it.
"""

from __future__ import annotations

import torch


def choose_next_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """(B, V) processed scores -> (B,) token ids: argmax, or a draw from softmax(scores)."""
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


class BeamHypotheses:
    """The best ``size`` finished sequences of one batch item (one beam group of it)."""

    def __init__(self, size: int, length_penalty: float, early_stopping: bool | str, max_length: int):
        self.size, self.length_penalty, self.early_stopping, self.max_length = (
            size, length_penalty, early_stopping, max_length)
        self.beams: list[tuple[float, torch.Tensor, torch.Tensor]] = []  # (score, token ids, beam indices)
        self.worst_score = 1e9

    def add(self, tokens: torch.Tensor, sum_logprobs: float, generated_len: int, beam_indices: torch.Tensor) -> None:
        score = sum_logprobs / (generated_len ** self.length_penalty)
        if len(self.beams) < self.size or score > self.worst_score:
            self.beams.append((score, tokens, beam_indices))
            if len(self.beams) > self.size:
                ranked = sorted((s, i) for i, (s, _, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, cur_len: int, prompt_len: int) -> bool:
        """Whether no running beam can still beat the worst kept hypothesis (per ``early_stopping``)."""
        if len(self.beams) < self.size:
            return False
        if self.early_stopping is True:
            return True
        length = cur_len - prompt_len
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_length - prompt_len  # a longer beam divides by more: its best possible score
        return self.worst_score >= best_sum_logprobs / length ** self.length_penalty


class BeamSearch:
    """State of a beam search over ``batch * num_beams`` rows (beams of one item are adjacent).

    Each step takes the processed log-probabilities of every row and returns the row each
    new beam continues (to reorder the cache with) and its next token.

    Example:
        >>> search = BeamSearch(batch=1, num_beams=2, prompt_length=3, max_length=5, eos_ids=[0], pad_id=0)
        >>> rows, tokens = search.step(torch.zeros(2, 3, dtype=torch.long), torch.log_softmax(torch.randn(2, 8), -1))
        >>> rows.shape, tokens.shape
        (torch.Size([2]), torch.Size([2]))
    """

    def __init__(self, *, batch: int, num_beams: int, prompt_length: int, max_length: int, eos_ids: list[int],
                 pad_id: int | None, num_beam_groups: int = 1, diversity_penalty: float = 0.0,
                 length_penalty: float = 1.0, early_stopping: bool | str = False, do_sample: bool = False):
        if num_beams % num_beam_groups:
            raise ValueError(f"num_beams ({num_beams}) must be a multiple of num_beam_groups ({num_beam_groups})")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        self.batch, self.num_beams, self.num_groups = batch, num_beams, num_beam_groups
        self.group_size = num_beams // num_beam_groups
        self.prompt_length, self.max_length = prompt_length, max_length
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.diversity_penalty, self.do_sample = diversity_penalty, do_sample
        # only the first beam of each group starts live, so the beams of a group do not all pick the same token
        scores = torch.full((batch, num_beams), -1e9)
        scores[:, ::self.group_size] = 0.0
        self.beam_scores = scores.view(-1)  # (B*N,) summed log-probs of the running beams
        self.hyps = [[BeamHypotheses(self.group_size, length_penalty, early_stopping, max_length)
                      for _ in range(num_beam_groups)] for _ in range(batch)]
        self.done = [[False] * num_beam_groups for _ in range(batch)]
        self.beam_indices = torch.zeros(batch * num_beams, 0, dtype=torch.long)  # (B*N, steps) row chosen per step
        self.processed_scores: torch.Tensor | None = None  # (B*N, V) of the last step
        self.sequences_scores: torch.Tensor | None = None  # set by finalize()
        self.sequence_beam_indices: torch.Tensor | None = None

    @property
    def is_done(self) -> bool:
        return all(all(row) for row in self.done)

    def _candidates(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, beams*V) accumulated scores -> the k best (or k sampled) (scores, flat indices), best first."""
        if not self.do_sample:
            return torch.topk(scores, k, dim=1, largest=True, sorted=True)
        picked = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=k)
        picked_scores = torch.gather(scores, 1, picked)
        picked_scores, order = torch.sort(picked_scores, descending=True, dim=1)
        return picked_scores, torch.gather(picked, 1, order)

    def step(self, input_ids: torch.Tensor, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` (B*N, L), processed ``log_probs`` (B*N, V) -> (rows to continue (B*N,), next tokens (B*N,))."""
        n, g, vocab = self.num_beams, self.group_size, log_probs.shape[-1]
        cur_len = input_ids.shape[1] + 1
        device = log_probs.device
        rows = torch.zeros(self.batch * n, dtype=torch.long)
        tokens = torch.zeros(self.batch * n, dtype=torch.long)
        new_scores = torch.zeros(self.batch * n)
        log_probs = log_probs.to("cpu", torch.float32, copy=True)  # (B*N, V); diversity penalties go in below
        ids = input_ids.cpu()
        k = max(2, 1 + len(self.eos_ids)) * g
        for group in range(self.num_groups):
            members = [b * n + group * g + j for b in range(self.batch) for j in range(g)]  # rows of this group
            if self.diversity_penalty and group > 0:
                # Hamming diversity: tokens already chosen at this step by earlier groups of the same item cost more
                for b in range(self.batch):
                    counts = torch.bincount(tokens[b * n: b * n + group * g], minlength=vocab).to(log_probs.dtype)
                    log_probs[b * n + group * g: b * n + (group + 1) * g] -= self.diversity_penalty * counts
            group_scores = log_probs[members]  # (B*g, V)
            total = (group_scores + self.beam_scores[members, None]).view(self.batch, g * vocab)
            top_scores, top_index = self._candidates(total, k)
            for b in range(self.batch):
                first = b * n + group * g
                if self.done[b][group]:  # finished: keep the rows alive with padding
                    rows[first:first + g] = first
                    tokens[first:first + g] = self.pad_id if self.pad_id is not None else 0
                    continue
                chosen = 0
                for rank, (score, index) in enumerate(zip(top_scores[b].tolist(), top_index[b].tolist())):
                    row, token = first + index // vocab, index % vocab
                    if token in self.eos_ids:
                        if rank < g:  # only a top-g candidate may finish
                            self.hyps[b][group].add(torch.cat([ids[row], torch.tensor([token])]), score,
                                                    cur_len - self.prompt_length,
                                                    torch.cat([self.beam_indices[row], torch.tensor([row])]))
                    else:
                        rows[first + chosen], tokens[first + chosen] = row, token
                        new_scores[first + chosen] = score
                        chosen += 1
                    if chosen == g:
                        break
                self.done[b][group] = self.hyps[b][group].is_done(max(top_scores[b].tolist()), cur_len,
                                                                  self.prompt_length)
        self.beam_scores = new_scores
        self.processed_scores = log_probs.to(device)  # what ranked the candidates (diversity penalty included)
        self.beam_indices = torch.cat([self.beam_indices[rows], rows[:, None]], dim=1)
        return rows.to(device), tokens.to(device)

    def finalize(self, input_ids: torch.Tensor, num_return_sequences: int) -> torch.Tensor:
        """The best ``num_return_sequences`` hypotheses per item (padded), best first.

        Their length-penalised scores are then in ``sequences_scores`` and the row each token
        came from in ``sequence_beam_indices`` (-1 past the end).
        """
        if num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({num_return_sequences}) must be <= num_beams ({self.num_beams})")
        ids = input_ids.cpu()
        for b in range(self.batch):
            for group in range(self.num_groups):
                if self.done[b][group]:
                    continue
                for j in range(self.group_size):  # running beams compete with the finished ones
                    row = b * self.num_beams + group * self.group_size + j
                    self.hyps[b][group].add(ids[row], float(self.beam_scores[row]), ids.shape[1] - self.prompt_length,
                                            self.beam_indices[row])
        best = []
        for b in range(self.batch):
            ranked = sorted((h for hyps in self.hyps[b] for h in hyps.beams), key=lambda h: h[0], reverse=True)
            best.extend(ranked[:num_return_sequences])
        width = max(len(tokens) for _, tokens, _ in best)  # finished hypotheses end with their EOS
        fill = self.pad_id if self.pad_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
        sequences = torch.full((len(best), width), fill, dtype=torch.long)
        indices = torch.full((len(best), width - self.prompt_length), -1, dtype=torch.long)
        for i, (_, tokens, beam_indices) in enumerate(best):
            sequences[i, :len(tokens)] = tokens
            indices[i, :len(beam_indices)] = beam_indices
        device = input_ids.device
        self.sequences_scores = torch.tensor([score for score, _, _ in best], dtype=torch.float32, device=device)
        self.sequence_beam_indices = indices.to(device)
        return sequences.to(device)
