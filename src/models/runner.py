"""ModelRunner: executes one scheduler step on a Llama-family model and samples.

The runner owns the model, the paged KV cache and a copy of every scheduled
request's state (:class:`~legato.models.input_batch.InputBatch`). Each
:meth:`ModelRunner.execute` applies the step's deltas, lays the scheduled
tokens out as one flat batch (decodes first), runs the forward with per-step
metadata built once, and samples a token for every request whose scheduled
tokens reach the end of its known tokens. It never decides policy: finishing,
admission and block allocation are the scheduler's.

On CUDA with a graph-safe backend (Triton) and without ``enforce_eager``,
pure-decode steps of up to :data:`~legato.models.cuda_graphs.MAX_CAPTURE_SIZE`
requests replay CUDA graphs captured at start-up
(:mod:`legato.models.cuda_graphs`); every other step, and everything on CPU,
runs eagerly. Sampling always runs outside the graphs.

Never imports trio. Sets no global torch state (threads, default dtype, grad mode).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import EngineConfig
from ..protocol.messages import (
    ModelRunnerOutput,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)
from ..protocol.params import LoRARequest
from ..structured.mask import step_bitmask
from .attention_backend import select_backend
from .config import load_model_config, resolve_device, resolve_dtype
from .cpu_linear import pack_linears
from .cuda_graphs import CaptureMode, DecodeGraphRunner, wants_decode_graphs
from .draft_proposer import DraftModelProposer
from .gguf_checkpoint import gguf_weights_file
from .input_batch import InputBatch
from .llama import KVCache, LlamaForCausalLM
from .loader import load_model
from .lora import RunnerLoRA
from .pooling import Pooler
from .registry import resolve_architecture
from .runner_memory import RunnerMemory
from .sampler import SamplingMetadata, greedy, sample, token_logprobs
from .spec_decode import SpecDecoder, logits_rows, place_drafts
from .step_metadata import build_metadata

if TYPE_CHECKING:  # imported by the rank workers only: it needs torch.distributed
    from .tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_CHUNK = 512  # rows of prompt logits materialised at a time


def _no_rows() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class StepForward:
    """A step ``ModelRunner.execute_model`` ran and ``sample_tokens`` has not sampled yet:
    its answer so far (``out``) and what sampling needs (``hidden`` None: nothing computed)."""

    out: ModelRunnerOutput
    order: np.ndarray = field(default_factory=_no_rows)
    rows: np.ndarray = field(default_factory=_no_rows)
    starts: np.ndarray = field(default_factory=_no_rows)
    ends: np.ndarray = field(default_factory=_no_rows)
    query_start_loc: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    sampling: np.ndarray = field(default_factory=_no_rows)  # indices into ``order`` that sample
    logits: torch.Tensor | None = None  # of the ``sampling`` rows, in order
    # Their tokens instead of logits, when every one is plain greedy (``InputBatch.plain_greedy``).
    greedy_tokens: torch.Tensor | None = None
    # Speculative decoding: drafts per entry of ``order`` (None: the step has none); a
    # drafted entry's logits are its last ``spec_lens[i] + 1`` rows.
    spec_lens: np.ndarray | None = None
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # The most drafts to propose per request after sampling (SchedulerOutput.draft_limits).
    draft_limits: dict[str, int] = field(default_factory=dict)


class ModelRunner(RunnerMemory):
    """Loads ``config.model`` and runs scheduler steps on it.

    Attributes (fixed after construction): ``num_kv_blocks``, ``max_model_len``
    (the config's, else the checkpoint's ``max_position_embeddings``; capped by
    the KV cache and any sliding window), ``block_size``, ``vocab_size``,
    ``eos_token_id`` / ``eos_token_ids``, ``dtype``, ``device``.

    The KV cache holds ``config.num_kv_blocks`` blocks, else as many as
    ``config.kv_cache_memory`` bytes allow, else (CUDA) 90% of the free memory
    after the weights and a profile run, else (CPU) 1 GiB capped at what
    ``max_model_len * max_num_seqs`` tokens need. ``attention_backend``
    overrides ``config.attention_backend`` (tests use "reference").
    ``parallel`` makes this runner one rank of a tensor-parallel group: it
    holds the rank's share of the model (:mod:`legato.models.tensor_parallel`)
    and a KV cache of the rank's KV heads; every rank of the group must be
    given the same steps.
    Construction blocks while the weights load and, on CUDA, while the decode
    graphs are captured (``decode_graphs``; None when steps run eagerly).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        attention_backend: str | None = None,
        parallel: TensorParallel | None = None,
    ) -> None:
        if config.model is None:
            raise ValueError("model: ModelRunner needs a model directory (config.model)")
        self.config = config
        self.model_dir = Path(config.model)
        self.device = resolve_device(config.device)
        _, mcfg = resolve_architecture(load_model_config(self.model_dir))
        self.parallel = parallel
        self._checkpoint_config = mcfg  # the whole model's figures
        if parallel is not None:
            mcfg = parallel.rank_config(mcfg)  # this rank's heads and MLP share
        self.model_config = mcfg
        self.dtype = resolve_dtype(config.dtype, mcfg.config_dtype, self.device)
        self.block_size = config.block_size
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids: list[int] = list(mcfg.eos_token_ids)
        self.kv_sliding_window: int | None = mcfg.uniform_window  # see WorkerReady
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.backend = select_backend(attention_backend or config.attention_backend, self.device)
        wanted_len = config.max_model_len or mcfg.max_position_embeddings
        # One rank, no LoRA: a GGUF file's quantized matrices stay quantized (native
        # kernels on CPU, Triton's on CUDA: models.quantized)
        self._keep_quantized = (
            gguf_weights_file(self.model_dir) is not None
            and self.device.type in ("cpu", "cuda")
            and parallel is None
            and not config.enable_lora
            and not config.gguf_dequantize
        )
        if parallel is None:
            self.model: LlamaForCausalLM = load_model(
                self.model_dir,
                mcfg,
                self.backend,
                self.dtype,
                self.device,
                wanted_len + 1,
                keep_quantized=self._keep_quantized,
            )
            quantized = self.model.quantized_bytes()
            if quantized:
                self.model.set_int8_max_rows(1 if config.gguf_activations == "int8" else 0)
                logger.info(
                    "GGUF weights kept quantized: %.0f MB, %s",
                    quantized / 2**20,
                    f"{config.gguf_activations} activations"
                    if self.device.type == "cpu"
                    else "Triton weight-only kernels",
                )
        else:
            self.model = parallel.load_model(
                self.model_dir,
                self._checkpoint_config,
                self.backend,
                self.dtype,
                self.device,
                wanted_len + 1,
            )
        self._param_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self._packed_bytes = pack_linears(self.model)  # CPU: oneDNN-packed matmul weights
        self.lora: RunnerLoRA | None = None
        if config.enable_lora:
            self.lora = RunnerLoRA(
                self.model,
                mcfg,
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras,
                dtype=self.dtype,
                device=self.device,
                use_triton=self.backend.name == "triton",
            )
        self.pooler = Pooler(config.pooling_type)
        spec = config.speculative_config
        self.draft: DraftModelProposer | None = None
        if spec is not None and spec.model is not None:
            # its KV cache shares the target's block ids (see .draft_proposer)
            self.draft = DraftModelProposer(
                spec,
                mcfg,
                config.tokenizer or config.model,
                backend=self.backend,
                dtype=self.dtype,
                device=self.device,
                max_positions=wanted_len + 1,
                seed=config.seed,
            )
        self.spec_decoder = SpecDecoder(spec, self.draft) if spec is not None else None
        self._step_started = 0.0  # when the step in progress began (execute_model)
        self.kv_block_bytes = (
            2
            * mcfg.num_layers
            * self.block_size
            * mcfg.num_kv_heads
            * mcfg.head_dim
            * self.dtype.itemsize
        ) + (self.draft.kv_block_bytes(self.block_size) if self.draft is not None else 0)
        self.num_kv_blocks = self._count_kv_blocks(wanted_len)
        self.max_model_len = min(wanted_len, self.num_kv_blocks * self.block_size)
        if self.max_model_len < wanted_len:
            logger.warning(
                "max_model_len capped at %d: the KV cache (%d blocks of %d) holds no more",
                self.max_model_len,
                self.num_kv_blocks,
                self.block_size,
            )
        self.kv_caches: list[KVCache] = self._allocate_kv_cache()
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks, config.max_num_seqs, self.block_size)
        self.input_batch = InputBatch(
            config.max_num_seqs,
            self.max_model_len,
            self.block_size,
            self.vocab_size,
            self.eos_token_ids,
            self.device,
            config.seed,
        )
        self._weights_state = "loaded"  # "loaded" | "offloaded" | "dropped"
        self.decode_graphs: DecodeGraphRunner | None = None
        self.verify_graphs: DecodeGraphRunner | None = None  # n-gram verification steps
        self._graph_settings: tuple[CaptureMode, list[int]] | None = None
        if parallel is not None and self.device.type == "cuda" and not config.enforce_eager:
            logger.info("tensor parallel: decode runs eagerly (no CUDA graphs)")
        elif self.draft is not None and self.device.type == "cuda":
            logger.info("draft model: decode runs eagerly (the graphs hold the target only)")
        elif not self.model.graph_capturable and self.device.type == "cuda":
            logger.info("%s: decode runs eagerly (its forward syncs with the host)",
                        mcfg.architecture)  # fmt: skip
        elif wants_decode_graphs(self.device, config.enforce_eager, self.backend):
            self.capture_decode_graphs()
        elif self.device.type == "cuda" and not config.enforce_eager:
            logger.info("backend %r is not graph-safe: decode runs eagerly", self.backend.name)

    # ------------------------------------------------------------ sizing

    # ------------------------------------------------------------- steps

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Apply ``step``'s deltas, compute its scheduled tokens, sample.

        Returns one entry per request in ``step.num_scheduled_tokens`` (its
        order): a sampled token when the scheduled tokens reach the end of the
        request's known tokens, else an empty list. A sampled token is also
        appended to the request's own tokens here: the next step computes it
        without the scheduler sending it back (so the scheduler can plan that
        step before this one's answer arrives). Raises ``RuntimeError`` while
        asleep and ``ValueError`` / ``KeyError`` on an inconsistent step.

        The same as ``sample_tokens(execute_model(step), step.grammar_bitmask)``.
        """
        return self.sample_tokens(self.execute_model(step), step.grammar_bitmask)

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> StepForward:
        """``execute``'s first half: the deltas, the forward, pooling and the logits of the
        rows that sample. ``sample_tokens`` must finish this step before any other runs
        (the next step computes its samples). Raises as ``execute``."""
        if self.sleeping:
            raise RuntimeError("the model runner is asleep: call wake_up() first")
        self._step_started = time.perf_counter()  # sample_tokens reports the step's time
        batch = self.input_batch
        for req_id in (*step.finished_req_ids, *step.preempted_req_ids):
            batch.remove(req_id)
            self.pooler.remove(req_id)
            if self.draft is not None:
                self.draft.forget(req_id)
            if self.lora is not None:
                self.lora.forget(req_id)
        for new in step.new_requests:
            self._admit(new, step.sampling_params[new.params_key])
        batch.update(step.cached_requests)
        req_ids = list(step.num_scheduled_tokens)
        out = ModelRunnerOutput(step.step_id, req_ids, [0] * len(req_ids), [])
        if not req_ids:
            return StepForward(out)
        rows_all = np.fromiter((batch.row(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
        n_all = np.fromiter(step.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        if self.lora is not None:  # requests whose adapter cannot be read: not computed
            out.failed = self.lora.unreadable(req_ids)
            if out.failed:
                n_all[[i for i, r in enumerate(req_ids) if r in out.failed]] = 0
        order = np.flatnonzero(n_all == 1)
        order = np.concatenate((order, np.flatnonzero(n_all > 1)))
        if len(order) == 0:
            return StepForward(out)
        rows, q_lens = rows_all[order], n_all[order]
        starts = batch.num_computed[rows]
        ends = starts + q_lens
        known = batch.num_tokens[rows]
        drafts = step.scheduled_spec_decode_tokens
        spec_lens = place_drafts(batch, drafts, req_ids, order) if drafts else None
        if spec_lens is not None:
            known = known + spec_lens  # the drafts are computed as if known
        self._check_step(req_ids, order, rows, ends, known)

        def argmax_only(sampled: np.ndarray) -> bool:
            """Whether the sampler would take these rows' argmax and nothing else."""
            return (
                spec_lens is None
                and not step.grammar_bitmask_follows
                and not step.grammar_bitmask
                and batch.plain_greedy(sampled)
            )

        uses_lora = self.lora is not None and self.lora.begin_step(
            [req_ids[int(k)] for k in order], q_lens
        )
        # A draft model computes its KV over the step's tokens unless every row is a decode
        # row proposing nothing after it (draft_limits 0): it catches up when it next proposes.
        observe = self.draft is not None and not (
            bool(np.all(q_lens == 1))
            and all(step.draft_limits.get(req_ids[int(k)], 1) == 0 for k in order)
        )
        graphs = self.decode_graphs
        query_start_loc: list[int]
        if (
            graphs is not None
            and not uses_lora  # the graphs hold the base model only
            and int(q_lens.max()) == 1
            and graphs.fits(len(rows), int(ends.max()))
        ):
            hidden = graphs.run(batch.token_ids[rows, starts], starts, batch.block_table[rows])
            query_start_loc = list(range(len(rows) + 1))
        elif (
            self.verify_graphs is not None
            and spec_lens is not None
            and not uses_lora
            and bool(np.all(q_lens == spec_lens + 1))  # every row: a last token or a draft
            and self.verify_graphs.fits(len(rows), int(ends.max()), int(q_lens.max()))
        ):
            cu = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(q_lens, out=cu[1:])
            seq = np.repeat(np.arange(len(rows)), q_lens)
            tokens = batch.token_ids[rows[seq], starts[seq] + np.arange(int(cu[-1])) - cu[seq]]
            hidden = self.verify_graphs.run(tokens, starts, batch.block_table[rows], q_lens)
            query_start_loc = cu.tolist()
        else:
            meta, seq_of_token, positions = build_metadata(
                starts, q_lens, batch.block_table[rows], self.block_size, self.device
            )
            if spec_lens is not None and bool(np.all(q_lens == spec_lens + 1)):
                # a verification step: every row is a decode row (last token, then drafts),
                # computed as a plain decode step computes it (.decode_stack)
                meta = replace(meta, rows_as_decodes=True)
            input_ids = torch.from_numpy(
                batch.token_ids[rows[seq_of_token], positions].astype(np.int64)
            ).to(self.device)
            if (
                len(rows) == 1  # one decode row that samples, its argmax and nothing else
                and q_lens[0] == 1
                and ends[0] == known[0]
                and not observe
                and not uses_lora
                and not len(self.pooler)
                and argmax_only(rows)
            ):
                hidden, greedy_tokens = self.model.forward_greedy(input_ids, self.kv_caches, meta)
                if greedy_tokens is not None:
                    return StepForward(
                        out, order, rows, starts, ends, meta.query_start_loc_host, hidden,
                        np.zeros(1, dtype=np.int64), None, greedy_tokens,
                        draft_limits=step.draft_limits,
                    )  # fmt: skip
            else:
                hidden = self.model(input_ids, self.kv_caches, meta)
            if observe:  # its KV over the same tokens and slots
                assert self.draft is not None
                spans = [(req_ids[int(k)], int(s), int(e)) for k, s, e in zip(order, starts, ends)]
                self.draft.observe(input_ids, meta, hidden, spans)
            query_start_loc = meta.query_start_loc_host

        sampling = np.flatnonzero(ends == known)
        if len(self.pooler):
            pooling = np.fromiter(
                (req_ids[int(k)] in self.pooler for k in order), dtype=bool, count=len(order)
            )
            sampling = sampling[~pooling[sampling]]
            self._pool(out, req_ids, order, starts, query_start_loc, hidden, pooling)
        logits = greedy_tokens = None
        if len(sampling):
            if spec_lens is None:
                last_rows = np.asarray(query_start_loc[1:], dtype=np.int64)[sampling] - 1
            else:
                last_rows = logits_rows(query_start_loc, sampling, spec_lens)
            logits = self.model.compute_logits(
                hidden.index_select(0, torch.from_numpy(last_rows).to(self.device)),
                None if spec_lens is None else len(sampling),  # each row as a plain step's
            )
            if argmax_only(rows[sampling]):  # take it now (bf16 logits as they are)
                greedy_tokens, logits = greedy(logits), None
        return StepForward(
            out,
            order,
            rows,
            starts,
            ends,
            query_start_loc,
            hidden,
            sampling,
            logits,
            greedy_tokens,
            spec_lens,
            drafts,
            step.draft_limits,
        )

    @torch.inference_mode()
    def sample_tokens(
        self, forward: StepForward, grammar_bitmask: dict[str, bytes]
    ) -> ModelRunnerOutput:
        """``execute``'s second half: sample the step ``execute_model`` ran, with its token
        bitmask rows (``SchedulerOutput.grammar_bitmask``'s form; a request without a row
        samples unconstrained), and the prompt logprobs. Returns ``execute``'s answer."""
        out = forward.out
        if forward.hidden is None:
            return out
        batch = self.input_batch
        req_ids = out.req_ids
        order, rows, starts, ends = forward.order, forward.rows, forward.starts, forward.ends
        query_start_loc, hidden = forward.query_start_loc, forward.hidden
        sampling = forward.sampling
        if forward.logits is not None and forward.spec_lens is not None:
            self._sample_verified(forward, grammar_bitmask)
        elif forward.logits is not None or forward.greedy_tokens is not None:
            logprobs: dict[int, TokenLogprobs] = {}
            if forward.greedy_tokens is not None:
                tokens = forward.greedy_tokens.tolist()
            else:
                assert forward.logits is not None
                md: SamplingMetadata = batch.sampling_metadata(rows[sampling])
                if grammar_bitmask:  # structured outputs: this step's token bitmask rows
                    sampled_ids = [req_ids[int(order[i])] for i in sampling.tolist()]
                    masks = step_bitmask(grammar_bitmask, sampled_ids, self.device)
                    if masks is not None:
                        md.token_bitmask, md.bitmask_rows = masks
                result = sample(forward.logits, md)
                tokens, logprobs = result.sampled.tolist(), result.logprobs
            for j, i in enumerate(sampling.tolist()):
                batch.append_tokens(int(rows[i]), [tokens[j]])
                if j in logprobs:
                    out.logprobs[req_ids[int(order[i])]] = [logprobs[j]]
            # One token per sampling request, flat in the step's request order.
            ks = order[sampling]
            by_k = np.argsort(ks, kind="stable")
            out.sampled_token_ids = np.asarray(tokens, dtype=np.int64)[by_k].tolist()
            counts = np.zeros(len(req_ids), dtype=np.int64)
            counts[ks] = 1
            out.num_sampled = counts.tolist()
        self._prompt_logprobs(out, req_ids, order, rows, starts, ends, query_start_loc, hidden)
        if forward.spec_lens is None:
            batch.num_computed[rows] = ends
        if self.spec_decoder is not None and len(sampling):
            self._propose(out, rows[sampling], forward.draft_limits)
            out.step_seconds = time.perf_counter() - self._step_started
        return out

    def _sample_verified(self, forward: StepForward, grammar_bitmask: dict[str, bytes]) -> None:
        """``sample_tokens`` for a step with drafts: verify them, append what is accepted
        and one more token per sampling request, roll the computed count back past the
        rejected drafts (their KV slots are rewritten by the next step)."""
        assert self.spec_decoder is not None and forward.logits is not None
        assert forward.spec_lens is not None
        out, batch, req_ids = forward.out, self.input_batch, forward.out.req_ids
        order, rows, sampling = forward.order, forward.rows, forward.sampling
        ids = [req_ids[int(order[i])] for i in sampling.tolist()]
        verified = self.spec_decoder.verify(
            batch, forward.logits, rows[sampling], ids, forward.drafts, grammar_bitmask
        )
        counts = np.zeros(len(req_ids), dtype=np.int64)
        by_request: dict[int, list[int]] = {}
        computed = forward.ends - forward.spec_lens  # the rejected drafts come off below
        for j, i in enumerate(sampling.tolist()):
            tokens = verified.tokens[j]
            k = int(order[i])
            batch.append_tokens(int(rows[i]), tokens)
            computed[i] += len(tokens) - 1
            counts[k] = len(tokens)
            by_request[k] = tokens
            if j in verified.logprobs:
                out.logprobs[ids[j]] = verified.logprobs[j]
        batch.num_computed[rows] = computed
        out.num_sampled = counts.tolist()
        out.sampled_token_ids = [t for k in sorted(by_request) for t in by_request[k]]

    def _propose(self, out: ModelRunnerOutput, rows: np.ndarray, limits: dict[str, int]) -> None:
        """Drafts for the next step of the requests at ``rows`` (those that sampled), up to
        what fits before ``max_model_len`` and their ``limits`` (a request not in it: up to
        ``num_speculative_tokens``), into ``out.spec_token_ids``."""
        assert self.spec_decoder is not None
        batch = self.input_batch
        row_list = rows.tolist()
        ids = [batch.state(row).req_id for row in row_list]
        rooms = self.max_model_len - batch.num_tokens[rows] - 1
        if limits:
            caps = [limits.get(rid, room) for rid, room in zip(ids, rooms.tolist(), strict=True)]
            rooms = np.minimum(rooms, np.asarray(caps, dtype=rooms.dtype))
        if self.draft is not None:
            if not bool((rooms > 0).any()):  # nobody proposes: not even the call (~60 us)
                return
            id_of = dict(zip(row_list, ids, strict=True))
            for row, drafts in self.draft.propose(batch, rows, rooms).items():
                out.spec_token_ids[id_of[row]] = drafts
            return
        for row, rid, room in zip(row_list, ids, rooms.tolist(), strict=True):
            if room > 0:
                drafts = self.spec_decoder.propose(batch, row, room)
                if drafts:
                    out.spec_token_ids[rid] = drafts

    def _admit(self, new: NewRequestData, params: RunnerSamplingParams) -> None:
        """Hold a new request's state (its adapter and pooling included)."""
        if new.pooling_params is not None:
            self.pooler.add(
                new.request_id,
                new.pooling_params,
                len(new.prompt_token_ids),
                new.num_computed_tokens,
            )
        if new.lora_request is not None and self.lora is None:
            raise ValueError(
                f"request {new.request_id!r}: lora_request needs an engine with enable_lora"
            )
        if self.lora is not None:
            self.lora.track(new.request_id, new.lora_request)
        self.input_batch.add(new, params)

    def _pool(
        self,
        out: ModelRunnerOutput,
        req_ids: list[str],
        order: np.ndarray,
        starts: np.ndarray,
        query_start_loc: list[int],
        hidden: torch.Tensor,
        pooling: np.ndarray,
    ) -> None:
        """Feed each pooling request's rows to the pooler; finished vectors go to ``out``."""
        for i in np.flatnonzero(pooling).tolist():
            rid = req_ids[int(order[i])]
            rows = hidden[query_start_loc[i] : query_start_loc[i + 1]]
            vector = self.pooler.chunk(rid, rows, int(starts[i]))
            if vector is not None:
                out.pooled[rid] = vector

    def _check_step(
        self,
        req_ids: list[str],
        order: np.ndarray,
        rows: np.ndarray,
        ends: np.ndarray,
        known: np.ndarray,
    ) -> None:
        bad = np.flatnonzero(ends > known)
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"request {req_ids[int(order[i])]!r}: scheduled up to token {int(ends[i])} "
                f"but only {int(known[i])} tokens are known"
            )
        short = np.flatnonzero(self.input_batch.num_blocks[rows] * self.block_size < ends)
        if len(short):
            i = int(short[0])
            raise ValueError(
                f"request {req_ids[int(order[i])]!r}: its blocks hold "
                f"{int(self.input_batch.num_blocks[rows[i]]) * self.block_size} tokens, "
                f"{int(ends[i])} scheduled"
            )

    def _prompt_logprobs(
        self,
        out: ModelRunnerOutput,
        req_ids: list[str],
        order: np.ndarray,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        query_start_loc: list[int],
        hidden: torch.Tensor,
    ) -> None:
        """Prompt logprobs for the prompt tokens whose predecessors were computed this step.

        A chunk computing positions ``s..e-1`` yields entries for prompt tokens
        ``s+1..min(e, n-1)`` (None first when ``s == 0``), so the chunks of one
        prefill together give exactly one entry per prompt token.
        """
        batch = self.input_batch
        for i in np.flatnonzero(batch.wants_prompt_logprobs[rows]).tolist():
            row = int(rows[i])
            st = batch.state(row)
            n_prompt = st.num_prompt_tokens
            start, end = int(starts[i]), int(ends[i])
            if start >= n_prompt:
                batch.wants_prompt_logprobs[row] = False
                continue
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            last = min(end, n_prompt - 1)  # last target position
            if last > start:
                base = query_start_loc[i]
                idx = torch.arange(base, base + last - start, device=self.device)
                targets = torch.from_numpy(
                    batch.token_ids[row, start + 1 : last + 1].astype(np.int64)
                ).to(self.device)
                num = st.params.prompt_logprobs
                assert num is not None
                for chunk in range(0, len(idx), _PROMPT_LOGPROBS_CHUNK):
                    piece = slice(chunk, chunk + _PROMPT_LOGPROBS_CHUNK)
                    logits = self.model.compute_logits(hidden.index_select(0, idx[piece]))
                    entries.extend(token_logprobs(logits, targets[piece], num))
            rid = req_ids[int(order[i])]
            out.prompt_logprobs.setdefault(rid, []).extend(entries)
            if end >= n_prompt:
                batch.wants_prompt_logprobs[row] = False

    # ------------------------------------------------------ memory, sleep

    @torch.inference_mode()
    # ------------------------------------------------------------- LoRA

    def _lora(self) -> RunnerLoRA:
        if self.lora is None:
            raise ValueError("enable_lora: LoRA adapters need an engine started with enable_lora")
        return self.lora

    def add_lora(self, request: LoRARequest | dict[str, Any]) -> bool:
        """Load an adapter into host memory (blocks while reading); LoRAError if unservable.

        ``request`` may be LoRARequest's fields as a dict (how a worker call carries it).
        """
        if isinstance(request, dict):
            request = LoRARequest(**request)
        return self._lora().add(request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin(lora_id)

    def list_loras(self) -> list[int]:
        return sorted(self._lora().ids()) if self.lora is not None else []

    # --------------------------------------------------------- utilities

    def embedding_size(self) -> int:
        """The length of a pooled vector: the model's hidden size."""
        return self.model_config.hidden_size

    def held_requests(self) -> list[str]:
        """Ids of the requests whose state the runner holds."""
        return list(self.input_batch.req_rows)
