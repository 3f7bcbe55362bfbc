"""What names a vLLM model's KV bytes besides its layer specs: the identity of its weights
(`Deployment.model_fingerprint`) and a digest of the settings that change KV values
(`Deployment.model_settings`), both part of every object's namespace. Called by
`setup.deployment_from` once per connector instance (scheduler role on the engine core, worker
role on each worker); no state. A checkpoint that cannot be identified gives '' and a warning
(objects are then keyed by the model id only), never an error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from layerkv.objects.fingerprint import checkpoint_fingerprint, settings_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

# hf_config keys that name the checkpoint, not its KV values
_UNRELATED_HF_KEYS = frozenset(
    {"_name_or_path", "_commit_hash", "transformers_version", "_attn_implementation_autoset"}
)


def model_fingerprint_of(vllm_config: VllmConfig) -> str:
    """The weights' identity: the pinned revision, else the HF snapshot's commit, else a
    fingerprint of the local checkpoint files; '' when none can be found (logged: a user
    should then pin `model_fingerprint`)."""
    model = vllm_config.model_config
    if model.revision:
        return f"revision={model.revision}"
    path = Path(str(model.model))
    if not path.exists():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(model.model), local_files_only=True))
            return f"snapshot={path.name}"  # the snapshot directory is named by its commit
        except Exception:  # noqa: BLE001 - no local snapshot: nothing to fingerprint
            log.warning(
                "layerkv: no revision and no local checkpoint for %s: objects are keyed by the model id "
                "only; set model_fingerprint in kv_connector_extra_config to pin the weights",
                model.model,
            )
            return ""
    fingerprint = checkpoint_fingerprint(path)
    return f"files={fingerprint}" if fingerprint else ""


def model_settings_of(vllm_config: VllmConfig) -> str:
    """Digest of what changes KV bytes besides the weights: the model config after
    hf_overrides (rope, layer count, quantization config, ...), the quantization method, the
    KV cache dtype and scale calculation, and speculative (draft / MTP) layers."""
    model = vllm_config.model_config
    hf = {k: v for k, v in model.hf_config.to_dict().items() if k not in _UNRELATED_HF_KEYS}
    spec = vllm_config.speculative_config
    return settings_digest(
        {
            "hf_config": hf,
            "dtype": str(model.dtype),
            "quantization": model.quantization,
            "cache_dtype": vllm_config.cache_config.cache_dtype,
            "calculate_kv_scales": getattr(vllm_config.cache_config, "calculate_kv_scales", None),
            "speculative": None
            if spec is None
            else {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens},
        }
    )
