"""The model runner: owns every tensor (weights, KV cache; encoder outputs through its EncoderRunner) and runs one
scheduled step."""

from __future__ import annotations

import contextlib
import resource
import time

import numpy as np
import torch

from vlserve import kernels
from vlserve.core.kv_cache_groups import group_layers
from vlserve.core.kv_cache_manager import cdiv
from vlserve.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from vlserve.distributed.pipeline import stage_layer_range
from vlserve.kernels import decode_workspace_numel
from vlserve.kernels.host_copy import to_device
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.lora import LoRAModelManager
from vlserve.models.capabilities import capabilities_of
from vlserve.models.hf_config import layer_windows_of, text_config_of
from vlserve.models.llama import decoder_of, kv_cache_spec
from vlserve.multimodal.mrope import mrope_positions_for_range
from vlserve.sampling_params import SamplingParams
from vlserve.worker.bidirectional import step_key_limits, token_runs
from vlserve.worker.compiled_forward import ModelForward, shape_classes
from vlserve.worker.cpu_allocator import tune_cpu_allocator
from vlserve.worker.deferred_samples import DeviceTokenFeed, StepHandle
from vlserve.worker.draft_inputs import build_draft_inputs
from vlserve.worker.encoder_runs import EncoderRunner, EncoderWork
from vlserve.worker.input_batch import InputBatch, step_token_ids
from vlserve.worker.kv_memory import zeroed_kv_tensor
from vlserve.worker.prompt_logprobs import PromptLogprobsCollector
from vlserve.worker.proposer import DraftKVSpec, Proposer
from vlserve.worker.pruned_positions import place_pruned_positions, pruned_items
from vlserve.worker.request_state import CachedRequestState
from vlserve.worker.sample_step import StepSampler, StepSamples
from vlserve.worker.sampler import make_generator


class ModelRunner:
    """Turns a SchedulerOutput into one flattened varlen batch, runs encoders + the model + the sampler."""

    def __init__(
        self,
        model: torch.nn.Module,
        hf_config,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        mrope_positions_fn=None,
        proposer: Proposer | None = None,
        compilation_config=None,
        enforce_eager: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
        lora_config: dict | None = None,
        prefill_only: bool = False,
    ):
        self.model = model
        if device.type == "cpu":  # projections through the packed C++ kernel where the CPU has one, torch's matmul
            tune_cpu_allocator()  # where it wins at many rows a call: towers, and all of a prefill-only (pooling) model
            pack_linears_for_cpu(model, many_rows=[model] if prefill_only else model.encoder_parts())
        # LoRA (`lora_config`: LoRAModelManager's max_loras / max_lora_rank / max_cpu_loras): the decoder's layers
        # become LoRA layers; an engine with LoRA runs its decoder without torch.compile, and on CUDA replays decode
        # graphs with the adapters' slots as a graph input (ModelForward). Adapters load off the step loop.
        self.lora_manager = None if lora_config is None else LoRAModelManager(model, **lora_config)
        self.forward = ModelForward(model, device, compilation_config, enforce_eager, lora=self.lora_manager)
        self.text_config = getattr(hf_config, "text_config", None) or hf_config
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # the target's caches (FP8 or the model's); the draft's: its own
        self.block_size = block_size
        self.vocab_size = self.text_config.vocab_size
        self.mrope_positions_fn = mrope_positions_fn  # (prompt_ids, mm_features, kept_indices=) -> ([3, P], delta)
        # runs of this token attend to themselves both ways in prefill (Gemma 3's image tokens), else None
        self.bidirectional_token_id: int | None = capabilities_of(model).bidirectional_token_id
        self.step_sampler = StepSampler()
        # Async scheduling: leave sampled ids on the device and feed the next step from them (deferred_samples.py)
        self.defer_readback = False
        self.token_feed = DeviceTokenFeed(device)
        # full and sliding-window layers in KV cache groups (core/kv_cache_groups.py): one group for most models
        self.kv_groups = group_layers(layer_windows_of(text_config_of(hf_config)))
        num_layers = self.kv_groups.num_layers
        # the layers whose KV this runner holds (a pipeline stage: its own run), and the cache slots they use
        self.kv_layers = range(*stage_layer_range(num_layers))
        self.kv_slots = sorted({self.kv_groups.slot_of(layer) for layer in self.kv_layers})
        self.input_batch = InputBatch(
            block_size,
            device,
            layer_groups=None
            if self.kv_groups.num_groups == 1
            else tuple(self.kv_groups.group_of(layer) for layer in range(num_layers)),
        )
        self.requests: dict[str, CachedRequestState] = {}
        self._last_order: tuple[list[str], list[CachedRequestState]] | None = None  # (req_ids, their states)
        self.num_penalized = 0  # >= the tracked requests with penalties or bad words (0: none has any)
        self.num_with_media = 0  # the tracked requests with media items
        self.prompt_logprobs = PromptLogprobsCollector()  # requests whose prompt logprobs are being computed
        # the towers' runs: encoder outputs by mm_hash, partial encodes, counters, the encoder-cache connector
        self.encoders = EncoderRunner(model, device, self.lora_manager)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.draft_kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # the proposer's own layer, if any
        self.attn_workspace: torch.Tensor | None = None  # flat scratch of the torch decode path (CPU backend only)
        self.proposer = None
        self.set_proposer(proposer)
        self.kv_connector = None  # a kv_transfer connector's worker side (`set_kv_connector`), or None
        self.pooler = None  # a pooling runner's Pooler (worker/pooler.py): it replaces the LM head and the sampler

    def set_kv_connector(self, connector) -> None:
        """Install a KV connector's worker side (after `initialize_kv_cache`): it gets the KV tensors (the EAGLE
        draft's too) now, and each step loads before the forward and saves after it (`execute_model`)."""
        self.kv_connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_caches, self.draft_kv_cache)

    def set_proposer(self, proposer: Proposer | None) -> None:
        """Install the spec-decode draft proposer or None. One with `uses_target_hidden_states` gets the target
        step's view in DraftInputs (and the residual streams at its `aux_layer_ids`); one with a
        `draft_kv_spec()` gets a KV layer allocated here alongside the target's."""
        was = getattr(self, "uses_hidden_states", False)
        self.proposer = proposer
        self.uses_hidden_states = bool(proposer is not None and proposer.uses_target_hidden_states)
        self.draft_kv_spec: DraftKVSpec | None = proposer.draft_kv_spec() if proposer is not None else None
        if self.uses_hidden_states:
            decoder_of(self.model).set_aux_hidden_state_layers(proposer.aux_layer_ids)
        elif was:
            decoder_of(self.model).set_aux_hidden_state_layers(())
        if self.kv_caches:
            self._allocate_draft_kv(self.kv_caches[0][0].shape[0])

    # -- KV cache ----------------------------------------------------------------------------------------------
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """`[NB, BS, Hkv, D]` of one layer's K (or V) cache; Hkv is this tensor-parallel rank's share."""
        _, num_kv_heads, head_dim = kv_cache_spec(self.text_config)
        return (num_blocks, self.block_size, num_kv_heads, head_dim)

    def bytes_per_block(self) -> int:
        """KV bytes one block id costs: a page of every slot (every layer, unless the model keeps several KV cache
        groups) at the KV cache dtype's size (an FP8 cache half of bf16's), plus the draft's own layer (same block
        ids)."""
        _, bs, h, d = self.kv_cache_shape(1)
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        per_block = 2 * len(self.kv_slots) * bs * h * d * elem
        if self.draft_kv_spec is not None:
            per_block += self.draft_kv_spec.bytes_per_block()
        return per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate zeroed K and V caches for every slot this stage's layers use: [NB, BS, Hkv, D] each in the KV
        cache dtype (and the draft's, if any); layer l uses its slot's pair (every layer its own, unless the model
        keeps KV groups; None for another pipeline stage's layers). On CPU their pages become resident only as blocks
        are written (`kv_memory`)."""
        shape = self.kv_cache_shape(num_blocks)
        slots = {
            slot: (
                zeroed_kv_tensor(shape, self.kv_cache_dtype, self.device),
                zeroed_kv_tensor(shape, self.kv_cache_dtype, self.device),
            )
            for slot in self.kv_slots
        }
        groups = self.kv_groups
        # None for the layers another pipeline stage holds
        self.kv_caches = [
            slots[groups.slot_of(layer)] if layer in self.kv_layers else None for layer in range(groups.num_layers)
        ]
        self._allocate_draft_kv(num_blocks)
        self.attn_workspace = self._allocate_attn_workspace(num_blocks)
        self.forward.graph_runner = None  # graphs point at the old caches; `warm_up_model` captures anew

    def _allocate_attn_workspace(self, num_blocks: int) -> torch.Tensor | None:
        """The decode scratch buffer the torch attention path gathers K/V into (None on the Triton backend), in the
        KV cache dtype, sized for the longest sequence the cache can hold (capped at max_position_embeddings)."""
        if kernels.get_attention_backend(self.device) != "torch":
            return None
        _, bs, h, d = self.kv_cache_shape(1)
        longest = min(num_blocks * bs, getattr(self.text_config, "max_position_embeddings", None) or num_blocks * bs)
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        with torch.inference_mode(False):  # written in and out of inference mode (profiling, steps)
            return torch.empty(
                decode_workspace_numel(longest, bs, h, d, elem), dtype=self.kv_cache_dtype, device=self.device
            )

    def _allocate_draft_kv(self, num_blocks: int) -> None:
        spec = self.draft_kv_spec
        if spec is None:
            self.draft_kv_cache = None
            return
        shape = (num_blocks, *spec.block_shape())  # [NB, BS, Hkv_draft, D_draft]
        self.draft_kv_cache = (
            zeroed_kv_tensor(shape, spec.dtype, self.device),
            zeroed_kv_tensor(shape, spec.dtype, self.device),
        )
        self.proposer.bind_kv_cache(self.draft_kv_cache)

    def profile_peak_activation_bytes(self, num_tokens: int) -> int:
        """Run one dummy prefill of num_tokens on throwaway 1-sequence KV caches (the runner's own caches are kept
        and restored); return its peak extra memory in bytes."""
        saved, saved_draft, saved_ws = self.kv_caches, self.draft_kv_cache, self.attn_workspace
        num_blocks = cdiv(num_tokens, self.block_size)
        num_groups = self.kv_groups.num_groups
        self.initialize_kv_cache(num_blocks * num_groups)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        dummy = NewRequestData(
            "__profile__",
            [0] * num_tokens,
            [],
            SamplingParams(max_tokens=1),
            [],
            tuple(list(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(num_groups)),
            0,
        )
        with self.forward.eager():  # no compile here: its memory would count as activations
            self.execute_model(SchedulerOutput([dummy], CachedRequestData(), {"__profile__": num_tokens}, num_tokens))
            self.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"__profile__"}))
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, 0)
        self.kv_caches, self.draft_kv_cache, self.attn_workspace = saved, saved_draft, saved_ws
        if saved_draft is not None:
            self.proposer.bind_kv_cache(saved_draft)
        return peak

    @torch.inference_mode()
    def warm_up_model(self, max_num_seqs: int, max_model_len: int) -> None:
        """At start-up, after `initialize_kv_cache`: compile every shape class of the decoder (`shape_classes`:
        dummy steps that write no KV) and capture CUDA graphs, per the compilation level."""

        def dummy_steps():
            for q_len, from_embeds in shape_classes(self.model):
                with torch.inference_mode(False):  # normal tensors, as the step buffers are: one dynamo guard
                    ids, positions, md = self._dummy_inputs(q_len)
                # [T, E] (E = H, or H * (1 + DeepStack levels) for Qwen3-VL), made in inference mode as a
                # step's merged embeddings are
                embeds = self.model.get_input_embeddings(ids) if from_embeds else None
                self.forward(ids, positions, self.kv_caches, md, inputs_embeds=embeds)

        self.forward.timed_warm_up(dummy_steps)
        if self.kv_groups.num_groups == 1:  # a graph replays one block table for every layer
            self.forward.capture_cuda_graphs(
                self.kv_caches, max_num_seqs, max_model_len, self.block_size, mrope=self.mrope_positions_fn is not None
            )

    def _dummy_inputs(self, q_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A `q_len`-token prefill (2) or decode (1) that writes no KV: input ids [T], positions [T] or [3, T]."""
        md = AttentionMetadata(
            slot_mapping=torch.full((q_len,), -1, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([q_len], dtype=torch.int32, device=self.device),
            block_tables=torch.zeros((1, cdiv(q_len, self.block_size)), dtype=torch.int32, device=self.device),
            num_decodes=int(q_len == 1),
            max_query_len=q_len,
            max_seq_len=q_len,
            query_start_loc_cpu=[0, q_len],
            seq_lens_cpu=[q_len],
            workspace=self.attn_workspace,
        )
        positions = torch.arange(q_len, device=self.device)  # [T]
        if self.mrope_positions_fn is not None:
            positions = positions.expand(3, q_len).contiguous()  # [3, T]
        return torch.zeros(q_len, dtype=torch.long, device=self.device), positions, md

    # -- state updates -----------------------------------------------------------------------------------------
    def _states_in_order(self, req_ids: list[str]) -> list[CachedRequestState]:
        """The states of req_ids (the last step's list again while no request came or went and the order holds)."""
        last = self._last_order
        if last is None or last[0] != req_ids:
            last = self._last_order = (list(req_ids), list(map(self.requests.__getitem__, req_ids)))
        return last[1]

    def _update_states(self, so: SchedulerOutput) -> None:
        if so.finished_req_ids or so.scheduled_new_reqs:
            self._last_order = None
        for rid in so.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self.num_penalized -= state.sampling_params.reads_output_tokens
                self.num_with_media -= bool(state.mm_features)
            self.input_batch.remove_request(rid)
        self.prompt_logprobs.drop(so.finished_req_ids)
        if self.pooler is not None:
            self.pooler.drop(so.finished_req_ids)
        if self.proposer is not None and so.finished_req_ids:
            self.proposer.remove_requests(so.finished_req_ids)
        if so.free_encoder_mm_hashes:  # evicted, or abandoned mid-encode
            self.encoders.free(so.free_encoder_mm_hashes)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            state = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                generator=make_generator(params.seed, self.device) if params.seed is not None else None,
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
                mm_features=new.mm_features,
                lora_request=new.lora_request,
            )
            if self.mrope_positions_fn is not None:
                state.mrope_positions, state.mrope_delta = self.mrope_positions_fn(
                    new.prompt_token_ids, new.mm_features
                )
                state.unplaced_pruned = pruned_items(new.mm_features)
            if self.bidirectional_token_id is not None:
                state.key_runs = token_runs(new.prompt_token_ids, self.bidirectional_token_id)
            self.requests[new.req_id] = state
            self.num_penalized += params.reads_output_tokens
            self.num_with_media += bool(new.mm_features)
            self.prompt_logprobs.start(new.req_id, params, len(new.output_token_ids))
            self.input_batch.add_request(new.req_id, new.block_ids)
        requests, cached = self.requests, so.scheduled_cached_reqs
        states = self._states_in_order(cached.req_ids)  # (the step's own order too when it adds no request)
        for rid, state, new_ids, n in zip(cached.req_ids, states, cached.new_block_ids, cached.num_computed_tokens):
            if new_ids:  # most decode steps add none
                state.block_ids.extend(new_ids[0])
                self.input_batch.append_blocks(rid, new_ids)
            state.num_computed_tokens = n
        if cached.new_token_ids is not None:  # pipeline stages: the tokens sampled since, up to the window's end
            for rid, c, sent in zip(cached.req_ids, cached.token_starts, cached.new_token_ids):
                requests[rid].token_ids[c : c + len(sent)] = sent

    # -- one step ----------------------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run the planned step; returns the sampled tokens of every request that reached its last token, and the
        step's timings."""
        return self.submit_step(so).output()

    @torch.inference_mode()
    def submit_step(self, so: SchedulerOutput) -> StepHandle:
        """Run the planned step up to its sampling; with `defer_readback` (async scheduling) the sampled ids may stay
        on the device until `output()` (deferred_samples.py). The one KV-connector seam: its loads land before the
        step runs (blocks of requests that wait for them, or that this step reads), its saves read the blocks after,
        and what ended is reported."""
        connector = self.kv_connector
        if connector is None:
            return self._execute_step(so)
        meta = so.kv_connector_metadata
        connector.start_load_kv(meta)
        out = self._execute_step(so, defer=False).output()
        connector.wait_for_save(meta)
        out.kv_connector_output = connector.get_finished()
        return StepHandle(out)

    def _execute_step(self, so: SchedulerOutput, defer: bool | None = None) -> StepHandle:
        t0 = time.perf_counter()
        defer = self.defer_readback if defer is None else defer
        self._update_states(so)
        encoded = self._run_encoders(so)  # (a step may carry only slices of a split item)
        if so.total_num_scheduled_tokens == 0:
            return StepHandle(
                ModelRunnerOutput(
                    [],
                    [],
                    encoder_seconds=encoded.seconds,
                    num_encoded_embeds=encoded.num_embeds,
                    step_seconds=time.perf_counter() - t0,
                )
            )
        # Decodes (one query token) first: the attention layer splits the batch there.
        n_sched = so.num_scheduled_tokens
        all_decodes = so.total_num_scheduled_tokens == len(n_sched)  # one token each: already in order
        req_ids = list(n_sched) if all_decodes else sorted(n_sched, key=lambda r: n_sched[r] != 1)
        states = self._states_in_order(req_ids)
        B = len(req_ids)
        if all_decodes:
            q_lens = np.ones(B, dtype=np.int64)  # [B]
        else:
            q_lens = np.fromiter((n_sched[r] for r in req_ids), dtype=np.int64, count=B)  # [B]
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=B)  # [B]
        step_ids = step_token_ids(so.scheduled_spec_decode_tokens, states, starts, q_lens, all_decodes)
        step = self.input_batch.prepare(req_ids, step_ids, q_lens, starts, self.attn_workspace)
        seq_lens, cu, md, input_ids = step.seq_lens, step.cu, step.attn_metadata, step.input_ids
        if self.defer_readback:  # ids sampled by a step whose read-back is deferred
            self.token_feed.fill(input_ids, step.input_ids_np, step.positions_np, cu, states)
        if self.bidirectional_token_id is not None:
            limits = step_key_limits([s.key_runs for s in states], starts, q_lens, cu, step.positions_np, self.device)
            md.set_key_limits(limits)
        if self.mrope_positions_fn is not None:  # pruned videos encoded by now take their kept positions
            place_pruned_positions(states, self.encoders, self.mrope_positions_fn)
        positions = self._positions(states, starts, q_lens, step)  # [T] or [3, T]
        media = self.num_with_media  # inputs_embeds: [T, H], or None without media
        inputs_embeds = self.merge_mm_embeddings(input_ids, states, starts, q_lens, cu) if media else None

        known = np.array([len(s.token_ids) for s in states], dtype=np.int64)
        sample_idx = np.nonzero(seq_lens >= known)[0]  # windows that reach their last known token sample (or pool)
        if self.pooler is not None and self.lora_manager is None:  # the last layer may compute the pool's rows alone
            md.output_rows = self.pooler.output_rows(cu, sample_idx, self.device)
        lora = (
            contextlib.nullcontext()
            if self.lora_manager is None  # each token runs its request's adapter
            else self.lora_manager.step([s.lora_request for s in states], q_lens.tolist())
        )
        with lora:
            hidden = self._run_model(input_ids, positions, md, inputs_embeds)  # [T, H]

        samples = None
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
        if self.pooler is not None:  # the pooling seam: prompts that ended are pooled, nothing is sampled
            out.pooler_output = self.pooler.pool(hidden, req_ids, starts, cu, known.tolist(), sample_idx)
            sample_idx = sample_idx[:0]
        handle = StepHandle(out)
        if self.prompt_logprobs.partial:
            out.prompt_logprobs = self._prompt_logprobs(hidden, states, starts, q_lens, cu)
        all_sample = len(sample_idx) == B  # (every decode step)
        if len(sample_idx):
            sample_states = states if all_sample else [states[i] for i in sample_idx.tolist()]
            spec = so.scheduled_spec_decode_tokens
            # (without drafts: one shared empty list, read only)
            drafts = [spec.get(s.req_id, []) for s in sample_states] if spec else [[]] * len(sample_states)
            defer = defer and self.proposer is None  # (a proposer reads the sampled tokens at once)
            if defer and self.num_penalized and any(s.sampling_params.reads_output_tokens for s in sample_states):
                self.token_feed.read_back_pending(sample_states)  # penalties / bad words read the outputs
            samples = self._sample_step(hidden, sample_states, cu[1:][sample_idx], drafts, so, keep_on_device=defer)
        spec_tokens: dict[str, list[int]] = {}
        # A hidden-state proposer runs even when nothing sampled: the draft still writes its KV for this chunk.
        if self.proposer is not None and (samples is not None or self.uses_hidden_states):
            spec_tokens = self.proposer.propose_drafts(
                build_draft_inputs(self, states, starts, q_lens, cu, positions, hidden, md, sample_idx)
            )
        if samples is not None and samples.device_tokens is not None:  # read back by handle.output()
            self.token_feed.defer(
                handle, sample_states, sample_idx.tolist(), samples.device_tokens, samples.device_logprobs
            )
        elif samples is not None:  # the sampled ids were read back to the host: the device work is done
            rows = samples.token_lists if all_sample else dict(zip(sample_idx.tolist(), samples.token_lists))
            out.sampled_token_ids = rows if all_sample else [rows.get(i, []) for i in range(B)]
            out.logprobs, out.spec_token_ids = samples.logprobs, spec_tokens
        elif self.device.type == "cuda" and not defer:
            torch.cuda.synchronize()  # nothing was read back: the forward may still be running
        out.encoder_seconds, out.num_encoded_embeds = encoded.seconds, encoded.num_embeds
        out.step_seconds = time.perf_counter() - t0
        return handle

    def _run_encoders(self, so: SchedulerOutput) -> EncoderWork:
        """Encode the items the scheduler released (`EncoderRunner.run`; a later pipeline stage encodes nothing)."""
        return self.encoders.run(so, self.requests)

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder over this step: `input_ids [T]`, `positions [T]|[3, T]` -> hidden `[T, H]` (a pipeline stage
        overrides it to receive and send the stream between stages)."""
        return self.forward(input_ids, positions, self.kv_caches, md, inputs_embeds=inputs_embeds)

    def _sample_step(
        self,
        hidden: torch.Tensor,
        states: list[CachedRequestState],
        ends: np.ndarray,
        drafts: list[list[int]],
        so: SchedulerOutput,
        keep_on_device: bool = False,
    ) -> StepSamples:
        """Sample the requests in `states` (appending their tokens, unless kept on the device); see
        `StepSampler.sample`."""
        return self.step_sampler.sample(
            self.model, hidden, states, ends, drafts, so.grammar_bitmask, so.grammar_rows, keep_on_device
        )

    def _prompt_logprobs(self, hidden, states, starts, q_lens, cu) -> dict:
        """The prompt logprobs of requests whose prompt ended this step (see `PromptLogprobsCollector.collect`)."""
        return self.prompt_logprobs.collect(self.model, hidden, states, starts, q_lens, cu)

    def _positions(self, states, starts, q_lens, step) -> torch.Tensor:
        if self.mrope_positions_fn is None:
            return self.input_batch.positions_on_device(step.num_tokens)  # [T]
        parts = [
            mrope_positions_for_range(state.mrope_positions, state.mrope_delta, s, s + n)
            for state, s, n in zip(states, starts.tolist(), q_lens.tolist())
        ]
        with torch.inference_mode(False):  # a normal tensor, as the text positions are: one dynamo guard for both
            return to_device(torch.cat(parts, dim=1), self.device)  # [3, T]

    def merge_mm_embeddings(
        self,
        input_ids: torch.Tensor,
        states,
        starts: np.ndarray,
        q_lens: np.ndarray,
        cu: np.ndarray,
        skip_missing: bool = False,
    ) -> torch.Tensor | None:
        """inputs_embeds [T, H] of input_ids [T] with the encoder outputs written over placeholder tokens, or None for
        text only (see `EncoderRunner.merge_embeddings`; a later pipeline stage embeds nothing)."""
        return self.encoders.merge_embeddings(input_ids, states, starts, q_lens, cu, skip_missing)
