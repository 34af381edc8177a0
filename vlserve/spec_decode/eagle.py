"""EAGLE / EAGLE-3 drafting: a one-layer draft head that reads the target's hidden states.

Draft checkpoint format (a directory; `speculative_config={"method": "eagle"|"eagle3", "model": DIR,
"num_speculative_tokens": k}`):

  config.json
    {"architectures": ["EagleDraftModel"],
     "method": "eagle" | "eagle3",
     "hidden_size": H (must equal the target's), "num_attention_heads", "num_key_value_heads",
     "intermediate_size", "rms_norm_eps", optional "head_dim" (default H / heads), "hidden_act" ("silu"),
     "attention_bias" (false: no q/k/v biases), "fc_bias" (false),
     "fc_input_norm" (false; true: RMSNorm the fc inputs first — eagle: enorm(embeds), hnorm(hidden); eagle3: each
     of the three target states — so their very different scales do not matter; training.train_eagle sets it),
     "input_layernorm" (eagle: false, as EAGLE-1; eagle3: always true),
     "final_norm" (true: logits = lm_head(norm(out))),
     eagle only:  "target_hidden": "pre_norm" (default: the target's final residual stream before its last norm)
                  | "post_norm" (the target's normed output, as original EAGLE-1 heads; use with final_norm false),
     eagle3 only: "target_layer_ids": [low, mid, high] — the residual stream at the INPUT of these target layers
                  (0 = embeddings, num_layers = final stream before the norm); default [2, L/2, L-3] (L >= 6) or
                  [0, L/2, L]; "draft_vocab_size" (default: the target's vocabulary),
     optional "vocab_size" (the target's; checked), "rope_theta"/"rope_scaling"/"max_position_embeddings"
     (default: the target's, so M-RoPE targets give M-RoPE drafts), anything else is kept and ignored}
  model.safetensors (any *.safetensors), HF-style names:
    fc.weight [H, 2H] (eagle) | [H, 3H] (eagle3), fc.bias if fc_bias,
    layers.0.self_attn.{q,k,v}_proj.weight [.., H] (eagle) | [.., 2H] (eagle3) (+ .bias if attention_bias),
    layers.0.self_attn.o_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight, layers.0.input_layernorm.weight (when on),
    layers.0.hidden_norm.weight (eagle3), enorm.weight [H] + hnorm.weight [H] (eagle) | hnorm.weight [3H]
    (eagle3) when fc_input_norm,
    optional: embed_tokens.weight, norm.weight, lm_head.weight [Vd, H] — the target's are shared when absent,
    d2t [Vd] int64 (eagle3 with a reduced vocabulary: target id = draft id + d2t[draft id]).
    "midlayer." is accepted for "layers.0." and fused qkv_proj / gate_up_proj tensors are split (EAGLE-3
    reference checkpoints); t2d is ignored.

How a step runs (`EagleProposer.propose_drafts`, called by the runner after the target forward and sampling):
  1. pass 0 over every row of the target step, with the target's own attention metadata (same slots, same
     block tables): row of position p gets the target hidden at p and the embedding of token p+1 (the next
     prompt token in a chunked prefill, the freshly sampled token at a request's last valid row, 0 for rows
     past it, i.e. rejected drafts, whose KV is overwritten before anything reads it). For multimodal targets
     the embeddings are the target's merged ones (media embeddings at placeholder positions) and the positions
     are the target's (M-RoPE). This writes the draft KV for every computed position.
  2. for each request that sampled: the output at its last valid row gives draft 1; k-1 more decode steps
     (argmax, one token each, positions L-1, L, ...) feed the draft's own output back, writing draft KV into the
     request's lookahead slots. Drafts stop early where the request's blocks or max_model_len end.
Preempted requests recompute from scratch like the target (the draft keeps no per-request state).
With prefix caching, a reused block carries the draft KV of the request that wrote it; at the block's last
position that KV saw that request's next token (only acceptance can differ, never output).
"""

from __future__ import annotations

import numpy as np
import torch

from vlserve.distributed.parallel_state import tp_size
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.capabilities import capabilities_of
from vlserve.spec_decode.eagle_checkpoint import load_eagle_draft
from vlserve.spec_decode.eagle_model import EagleConfig, EagleDraftModel, default_eagle3_layer_ids
from vlserve.worker.proposer import DraftInputs, DraftKVSpec


class EagleProposer:
    """Draft head + its one-layer KV cache (allocated by the runner from `draft_kv_spec()`); a
    `vlserve.worker.proposer.Proposer`: `propose_drafts(DraftInputs) -> {req_id: [draft ids]}`."""

    uses_target_hidden_states = True

    def __init__(
        self, draft: EagleDraftModel, k: int, max_model_len: int, block_size: int, target_num_layers: int
    ) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.draft = draft
        self.k = int(k)
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        self.method = draft.cfg.method
        cfg = draft.cfg
        if self.method == "eagle3":
            ids = cfg.target_layer_ids or default_eagle3_layer_ids(target_num_layers)
            bad = [i for i in ids if not 0 <= i <= target_num_layers]
            if bad:
                raise ValueError(f"EAGLE-3 target_layer_ids {bad} out of range for a {target_num_layers}-layer target")
            self.aux_layer_ids: list[int] = list(ids)
        else:
            self.aux_layer_ids = [target_num_layers] if cfg.target_hidden == "pre_norm" else []
        p = next(draft.parameters())
        self.device, self.dtype = p.device, p.dtype
        attn = draft.layers[0].self_attn
        self.kv_head_shape = (attn.num_kv_heads, attn.head_dim)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_propose_calls = 0

    @classmethod
    def from_config(
        cls, spec_config, target: torch.nn.Module, target_hf_config, device, dtype, max_model_len: int, block_size: int
    ) -> EagleProposer:
        text_cfg = getattr(target_hf_config, "text_config", None) or target_hf_config
        cfg = EagleConfig.from_dir(spec_config.model)
        if cfg.method != spec_config.method:
            raise ValueError(
                f"speculative_config method {spec_config.method!r} does not match the draft "
                f"checkpoint's method {cfg.method!r} ({spec_config.model})"
            )
        draft = load_eagle_draft(spec_config.model, target, text_cfg, device, dtype)
        return cls(draft, spec_config.num_speculative_tokens, max_model_len, block_size, text_cfg.num_hidden_layers)

    # -- runner interface (vlserve.worker.proposer.Proposer) ---------------------------------------------------
    def draft_kv_spec(self) -> DraftKVSpec:
        """One KV layer in the target's block layout (indexed by the target's block ids)."""
        return DraftKVSpec(self.block_size, *self.kv_head_shape, self.dtype)

    def bind_kv_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.kv_cache = kv_cache

    def remove_requests(self, req_ids) -> None:
        """No per-request state."""

    def select_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target states the draft reads, from the model output and the kept aux states (aux_layer_ids)."""
        if self.method == "eagle3":
            return torch.cat(aux, dim=-1)
        return aux[0] if self.aux_layer_ids else hidden

    @torch.inference_mode()
    def propose_drafts(self, inp: DraftInputs) -> dict[str, list[int]]:
        """Pass 0 over the target step, then up to k - 1 draft decode steps per sampled request."""
        if self.kv_cache is None:
            raise RuntimeError("EagleProposer: the runner has not bound its KV cache (bind_kv_cache)")
        self.num_propose_calls += 1
        draft = self.draft
        embeds = inp.inputs_embeds if inp.inputs_embeds is not None else draft.embed(inp.input_ids)
        target_hidden = self.select_hidden(inp.hidden_states, inp.aux_hidden_states)  # [T, H] or [T, 3H]
        out = draft(
            embeds.to(self.dtype),
            target_hidden.to(self.dtype),
            inp.positions,
            self.kv_cache,
            inp.attn_metadata,
            from_target=True,
        )  # [T, H]
        if not inp.req_ids:
            return {}
        dev = self.device
        # Drafts per request: k, capped by max_model_len (drafts at positions L .. L+k_i-1) and by the KV slots
        # of the decode steps (step j writes position L-1+j, j < k_i - 1).
        L = inp.seq_lens.astype(np.int64)
        k_i = np.minimum(np.minimum(self.k, self.max_model_len - L), inp.num_slots - L + 2)
        rows = torch.from_numpy(inp.last_rows.astype(np.int64)).to(dev)
        h = out.index_select(0, rows)  # [B', H]
        tok = draft.propose_ids(h)  # [B']
        drafts = [tok]
        active = np.arange(len(inp.req_ids))  # indices (into B') still drafting
        md = inp.attn_metadata
        bs = self.block_size
        for j in range(int(k_i.max(initial=0)) - 1):
            keep = k_i[active] > j + 1
            if not keep.all():
                sel = torch.from_numpy(np.nonzero(keep)[0]).to(dev)
                h, tok = h.index_select(0, sel), tok.index_select(0, sel)
                active = active[keep]
            if len(active) == 0:
                break
            pos_np = L[active] - 1 + j  # [b]
            btab = md.block_tables.index_select(
                0, torch.from_numpy(inp.batch_rows[active].astype(np.int64)).to(md.block_tables.device)
            )
            pos = torch.from_numpy(pos_np).to(dev)
            slots = btab.gather(1, (pos // bs).unsqueeze(1).to(btab.device)).squeeze(1).long() * bs + pos % bs
            b = len(active)
            seq_lens = pos_np + 1
            step_md = AttentionMetadata(
                slot_mapping=slots,
                query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
                block_tables=btab,
                num_decodes=b,
                max_query_len=1,
                max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=list(range(b + 1)),
                seq_lens_cpu=seq_lens.tolist(),
                workspace=md.workspace,
            )
            if inp.mrope_deltas is not None:
                positions = pos + torch.from_numpy(inp.mrope_deltas[active].astype(np.int64)).to(dev)
                positions = positions.unsqueeze(0).expand(3, -1).contiguous()
            else:
                positions = pos
            h = draft(draft.embed(tok), h, positions, self.kv_cache, step_md, from_target=False)
            tok = draft.propose_ids(h)
            full = torch.full((len(inp.req_ids),), -1, dtype=torch.long, device=dev)
            full[torch.from_numpy(active).to(dev)] = tok
            drafts.append(full)
        table = torch.stack(drafts, dim=1).tolist()  # [B', steps]
        result = {}
        for i, rid in enumerate(inp.req_ids):
            n = max(int(k_i[i]), 0)
            result[rid] = table[i][:n]
        return result


def build_eagle_proposer(spec_config, loaded, max_model_len: int, block_size: int) -> EagleProposer:
    """EagleProposer for `loaded` (vlserve.engine.model_setup.LoadedModel); ValueError under tensor parallelism
    (the draft head is not sharded)."""
    if tp_size() > 1:
        raise ValueError(
            f"EAGLE speculative decoding is not supported with tensor_parallel_size > 1 (got "
            f"{tp_size()}); use method 'ngram' or tensor_parallel_size=1"
        )
    if capabilities_of(loaded.model).pooling:
        raise ValueError(
            f"EAGLE drafting needs a target with an lm_head; {type(loaded.model).__name__} is a pooling model"
        )
    return EagleProposer.from_config(
        spec_config, loaded.model, loaded.hf_config, loaded.device, loaded.dtype, max_model_len, block_size
    )
