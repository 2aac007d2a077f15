"""The model runner's persistent per-request state, one row per held request.

Scalars live in NumPy arrays indexed by row (token ids, counts, block table,
sampling knobs, feature flags), so a step's metadata is a handful of
vectorised gathers rather than a loop over requests. Tensors a request needs
for sampling (prompt mask and output counts for penalties, allowed-token
mask, logit bias, its generator) are built once at admission and updated
incrementally as tokens arrive.

Never imports trio.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..protocol.messages import CachedRequestData, NewRequestData, RunnerSamplingParams
from .sampler import PenaltyInputs, SamplingMetadata

_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def bad_words_banned(bad_words_token_ids: list[list[int]], output: list[int]) -> list[int]:
    """The tokens ``bad_words`` ban at the next position (vLLM's rule): a word's last
    token, when the output so far ends with the rest of the word."""
    banned = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or output[-prefix:] == word[:-1]:
            banned.append(word[-1])
    return banned


def step_seed(seed: int, num_output_tokens: int) -> int:
    """A 63-bit seed for a seeded request's draw at output position ``num_output_tokens``.

    Depends on nothing else, so a request samples the same whatever shares its
    batch and whether or not it was preempted and recomputed (splitmix64 mix).
    """
    z = (seed * 0x9E3779B97F4A7C15 + num_output_tokens * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(slots=True)
class RequestState:
    """Per-request tensors and bookkeeping that do not fit a NumPy column."""

    req_id: str
    row: int
    params: RunnerSamplingParams
    num_prompt_tokens: int
    seed: int | None = None
    generator: torch.Generator | None = None
    prompt_mask: torch.Tensor | None = None  # [V] bool (penalties)
    output_counts: torch.Tensor | None = None  # [V] int32 (penalties)
    allowed_mask: torch.Tensor | None = None  # [V] bool
    bias_cols: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    stop_ids: torch.Tensor | None = None  # masked until min_tokens outputs exist


class InputBatch:
    """Rows of request state; rows are reused as requests come and go."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        seed: int,
    ) -> None:
        self.max_tokens = max_model_len + 1
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.engine_generator = torch.Generator(device=device)
        self.engine_generator.manual_seed(seed)
        self.req_rows: dict[str, int] = {}
        self.states: list[RequestState | None] = []
        self._free: list[int] = []
        cols = -(-self.max_tokens // block_size) + 1
        self.token_ids = np.zeros((0, self.max_tokens), dtype=np.int32)
        self.block_table = np.zeros((0, cols), dtype=np.int32)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_prompt = np.zeros(0, dtype=np.int64)
        self.num_computed = np.zeros(0, dtype=np.int64)
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.temperature = np.zeros(0, dtype=np.float32)
        self.top_p = np.zeros(0, dtype=np.float32)
        self.top_k = np.zeros(0, dtype=np.int64)
        self.min_p = np.zeros(0, dtype=np.float32)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.repetition = np.zeros(0, dtype=np.float32)
        self.presence = np.zeros(0, dtype=np.float32)
        self.frequency = np.zeros(0, dtype=np.float32)
        self.num_logprobs = np.zeros(0, dtype=np.int64)  # -2: none
        self.has_seed = np.zeros(0, dtype=bool)
        self.has_penalty = np.zeros(0, dtype=bool)
        self.has_allowed = np.zeros(0, dtype=bool)
        self.has_bias = np.zeros(0, dtype=bool)
        self.has_bad_words = np.zeros(0, dtype=bool)
        self.wants_prompt_logprobs = np.zeros(0, dtype=bool)  # until the prompt is computed
        self._grow(max_num_reqs)

    # ------------------------------------------------------------ rows

    _ROW_ARRAYS = (
        "token_ids", "block_table", "num_tokens", "num_prompt", "num_computed", "num_blocks",
        "temperature", "top_p", "top_k", "min_p", "min_tokens", "repetition", "presence",
        "frequency", "num_logprobs", "has_seed", "has_penalty", "has_allowed", "has_bias",
        "has_bad_words", "wants_prompt_logprobs",
    )  # fmt: skip

    def _grow(self, extra: int) -> None:
        old = len(self.states)
        for name in self._ROW_ARRAYS:
            arr = getattr(self, name)
            pad = [(0, extra)] + [(0, 0)] * (arr.ndim - 1)
            setattr(self, name, np.pad(arr, pad))
        self.states.extend([None] * extra)
        self._free.extend(range(old + extra - 1, old - 1, -1))

    def _ensure_block_cols(self, needed: int) -> None:
        cols = self.block_table.shape[1]
        if needed > cols:
            self.block_table = np.pad(self.block_table, [(0, 0), (0, max(needed, 2 * cols) - cols)])

    def __len__(self) -> int:
        return len(self.req_rows)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_rows

    def row(self, req_id: str) -> int:
        try:
            return self.req_rows[req_id]
        except KeyError:
            raise KeyError(f"the model runner holds no request {req_id!r}") from None

    def state(self, row: int) -> RequestState:
        st = self.states[row]
        assert st is not None
        return st

    # --------------------------------------------------------- deltas

    def add(self, new: NewRequestData, params: RunnerSamplingParams) -> None:
        """Admit a request (or re-admit one after preemption), replacing any old state.

        ``params``: what it samples with (its step's ``sampling_params[new.params_key]``).
        """
        if new.request_id in self.req_rows:
            self.remove(new.request_id)
        if not self._free:
            self._grow(max(len(self.states), 1))
        row = self._free.pop()
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        if len(tokens) > self.max_tokens:
            raise ValueError(
                f"request {new.request_id!r} has {len(tokens)} tokens, "
                f"more than max_model_len ({self.max_tokens - 1})"
            )
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt[row] = len(new.prompt_token_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        greedy = params.temperature < _EPS
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        self.repetition[row] = params.repetition_penalty
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.num_logprobs[row] = -2 if params.logprobs is None else params.logprobs
        penalised = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self.has_seed[row] = new.seed is not None and not greedy
        self.has_penalty[row] = penalised
        self.has_allowed[row] = params.allowed_token_ids is not None
        self.has_bias[row] = bool(params.logit_bias)
        self.has_bad_words[row] = bool(params.bad_words_token_ids)
        # A request recomputed after preemption has had its prompt logprobs already.
        self.wants_prompt_logprobs[row] = (
            params.prompt_logprobs is not None and not new.output_token_ids
        )
        st = RequestState(
            req_id=new.request_id,
            row=row,
            params=params,
            num_prompt_tokens=len(new.prompt_token_ids),
            seed=new.seed,
        )
        vocab, dev = self.vocab_size, self.device
        if self.has_seed[row]:
            st.generator = torch.Generator(device=dev)
        if penalised:
            prompt = torch.tensor(new.prompt_token_ids, dtype=torch.long, device=dev)
            st.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
            st.prompt_mask[prompt[prompt < vocab]] = True
            st.output_counts = torch.zeros(vocab, dtype=torch.int32, device=dev)
            self._count_outputs(st, new.output_token_ids)
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=dev)
            st.allowed_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
            st.allowed_mask[allowed[allowed < vocab]] = True
        if params.logit_bias:
            items = [(t, b) for t, b in params.logit_bias.items() if t < vocab]
            st.bias_cols = torch.tensor([t for t, _ in items], dtype=torch.long, device=dev)
            st.bias_values = torch.tensor([b for _, b in items], dtype=torch.float32, device=dev)
        if params.min_tokens > 0:
            stop = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop.update(self.eos_token_ids)
            ids = sorted(t for t in stop if t < vocab)
            st.stop_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        self.states[row] = st
        self.req_rows[new.request_id] = row

    def update(self, cached: CachedRequestData) -> None:
        """One step's changes to held requests: append the tokens and blocks sent, and
        take the scheduler's computed counts (one vectorised store for the whole batch).
        Raises KeyError for a request the runner does not hold."""
        for req_id, token_ids in cached.new_token_ids.items():
            self.append_tokens(self.row(req_id), token_ids)
        for req_id, block_ids in cached.new_block_ids.items():
            self._append_blocks(self.row(req_id), block_ids)
        if cached.req_ids:
            rows = [self.row(r) for r in cached.req_ids]
            self.num_computed[rows] = cached.num_computed_tokens

    def append_tokens(self, row: int, new: list[int]) -> None:
        """Append tokens to a request's known tokens (the runner's own samples, or a delta)."""
        start = int(self.num_tokens[row])
        if start + len(new) > self.max_tokens:
            raise ValueError(
                f"request {self.state(row).req_id!r} would exceed max_model_len "
                f"({self.max_tokens - 1} tokens)"
            )
        self.token_ids[row, start : start + len(new)] = new
        self.num_tokens[row] = start + len(new)
        st = self.state(row)
        if st.output_counts is not None:
            self._count_outputs(st, new)

    def remove(self, req_id: str) -> None:
        """Drop a request's state; unknown ids are ignored."""
        row = self.req_rows.pop(req_id, None)
        if row is None:
            return
        self.states[row] = None
        self._free.append(row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        self._ensure_block_cols(start + len(block_ids))
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def _count_outputs(self, st: RequestState, tokens: list[int]) -> None:
        assert st.output_counts is not None
        ids = [t for t in tokens if t < self.vocab_size]
        if ids:
            idx = torch.tensor(ids, dtype=torch.long, device=self.device)
            st.output_counts.index_put_(
                (idx,), torch.ones_like(idx, dtype=torch.int32), accumulate=True
            )

    # ------------------------------------------------------- sampling

    def plain_greedy(self, rows: np.ndarray) -> bool:
        """Whether every row at ``rows`` samples as the bare argmax of its logits: greedy,
        with nothing :meth:`sampling_metadata` would make the sampler apply first
        (penalties, allowed ids, bias, bad words, min_tokens' bans) and no logprobs."""
        n_out = self.num_tokens[rows] - self.num_prompt[rows]
        return bool(
            (self.temperature[rows] < _EPS).all()
            and not self.has_penalty[rows].any()
            and not self.has_allowed[rows].any()
            and not self.has_bias[rows].any()
            and not self.has_bad_words[rows].any()
            and (n_out >= self.min_tokens[rows]).all()
            and (self.num_logprobs[rows] < -1).all()
        )

    def sampling_metadata(
        self, rows: np.ndarray, pending: list[list[int]] | None = None
    ) -> SamplingMetadata:
        """Sampler inputs for ``rows`` (one logits row each, in this order).

        ``pending[i]`` (speculative decoding): tokens not held yet that precede entry
        ``i``'s position (the drafts before it), counted as output by its seed's step,
        min_tokens, penalties and bad_words; a row may then appear several times, each
        entry with its own generator.
        """
        dev = self.device
        extra = (
            np.zeros(len(rows), dtype=np.int64)
            if pending is None
            else np.fromiter((len(p) for p in pending), dtype=np.int64, count=len(rows))
        )
        vocab = self.vocab_size
        temp = self.temperature[rows]
        greedy_np = temp < _EPS
        all_greedy = bool(greedy_np.all())
        any_greedy = bool(greedy_np.any())

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(dev)

        top_k = top_p = min_p = None
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            tk = self.top_k[rows]
            if ((tk > 0) & (tk < vocab)).any():
                top_k = t(np.where((tk > 0) & (tk < vocab), tk, vocab))
            tp = self.top_p[rows]
            if (tp < 1.0).any():
                top_p = t(tp)
            mp = self.min_p[rows]
            if (mp > 0.0).any():
                min_p = t(mp)
            n_out = self.num_tokens[rows] - self.num_prompt[rows] + extra
            for i in np.flatnonzero(self.has_seed[rows]).tolist():
                st = self.state(int(rows[i]))
                assert st.generator is not None and st.seed is not None
                gen = st.generator if pending is None else torch.Generator(device=dev)
                gen.manual_seed(step_seed(st.seed, int(n_out[i])))
                generators[i] = gen
        md = SamplingMetadata(
            temperature=t(np.where(greedy_np, np.float32(1.0), temp)),
            greedy=t(greedy_np) if any_greedy and not all_greedy else None,
            all_greedy=all_greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            engine_generator=self.engine_generator,
        )
        pen = np.flatnonzero(self.has_penalty[rows]).tolist()
        if pen:
            states = [self.state(int(rows[i])) for i in pen]
            pr = rows[pen]
            md.penalties = PenaltyInputs(
                rows=torch.tensor(pen, dtype=torch.long, device=dev),
                prompt_mask=torch.stack([s.prompt_mask for s in states]),  # type: ignore[misc]
                output_counts=torch.stack([s.output_counts for s in states]),  # type: ignore[misc]
                repetition=t(self.repetition[pr]),
                presence=t(self.presence[pr]),
                frequency=t(self.frequency[pr]),
            )
            if pending is not None:  # the drafts before each position count as output
                counts = md.penalties.output_counts
                for k, i in enumerate(pen):
                    ids = [tok for tok in pending[i] if tok < vocab]
                    if ids:
                        idx = torch.tensor(ids, dtype=torch.long, device=dev)
                        counts[k].index_put_(
                            (idx,), torch.ones_like(idx, dtype=counts.dtype), accumulate=True
                        )
        allowed = np.flatnonzero(self.has_allowed[rows]).tolist()
        if allowed:
            md.allowed_rows = torch.tensor(allowed, dtype=torch.long, device=dev)
            md.allowed_mask = torch.stack([self.state(int(rows[i])).allowed_mask for i in allowed])  # type: ignore[misc]
        biased = np.flatnonzero(self.has_bias[rows]).tolist()
        if biased:
            bias_rows, bias_cols, bias_vals = [], [], []
            for i in biased:
                st = self.state(int(rows[i]))
                assert st.bias_cols is not None and st.bias_values is not None
                bias_rows.append(torch.full_like(st.bias_cols, i))
                bias_cols.append(st.bias_cols)
                bias_vals.append(st.bias_values)
            md.bias_rows = torch.cat(bias_rows)
            md.bias_cols = torch.cat(bias_cols)
            md.bias_values = torch.cat(bias_vals)
        n_out_all = self.num_tokens[rows] - self.num_prompt[rows] + extra
        banned = np.flatnonzero(n_out_all < self.min_tokens[rows]).tolist()
        ban_rows, ban_cols = [], []
        for i in banned:
            st = self.state(int(rows[i]))
            if st.stop_ids is not None and st.stop_ids.numel():
                ban_rows.append(torch.full_like(st.stop_ids, i))
                ban_cols.append(st.stop_ids)
        for i in np.flatnonzero(self.has_bad_words[rows]).tolist():
            row = int(rows[i])
            output = self.token_ids[row, self.num_prompt[row] : self.num_tokens[row]].tolist()
            if pending is not None:
                output += pending[i]
            words = self.state(row).params.bad_words_token_ids
            ids = [t for t in bad_words_banned(words, output) if t < vocab]
            if ids:
                ban_cols.append(torch.tensor(ids, dtype=torch.long, device=dev))
                ban_rows.append(torch.full_like(ban_cols[-1], i))
        if ban_rows:  # min_tokens' stop ids, bad_words' next tokens
            md.banned_rows = torch.cat(ban_rows)
            md.banned_cols = torch.cat(ban_cols)
        nlp = self.num_logprobs[rows]
        lp_rows = np.flatnonzero(nlp >= -1)
        if len(lp_rows):
            md.logprob_rows = lp_rows.tolist()
            md.num_logprobs = nlp[lp_rows].tolist()
        return md
