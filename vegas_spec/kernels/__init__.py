"""Triton kernels behind the attention-backend seam, one kernel (and its host wrapper) per file.

  paged_attention   causal attention over the paged cache for 1..n query rows, with the
                    selection scores of chosen rows fused into the same pass (verify, prefill)
  sparse_attention  attention over listed positions plus the recent range (draft steps)
  split_merge       merge of the key splits of both (flash-decoding), shared tile helpers
  store_kv          a step's new K/V into their cache slots
  topk              top-k positions per (layer, sequence, group) by radix select (selection)

Every kernel has a plain-PyTorch reference (`vegas_spec.attention.torch_backend`,
`vegas_spec.spec.policies.topk_positions`) that is its test oracle. On a machine without CUDA
the kernels run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`, set before
triton is first imported)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fix_interpreter_index() -> None:
    """Triton <= 3.6's interpreter turns a scalar into an int with `int(array)` on a 1-element
    array, which NumPy >= 2.4 refuses (triton-lang/triton#9171): every loop with a runtime
    bound fails. Take the single element explicitly."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_squeezes_index", False):
        return

    def patch(tensor, scope) -> None:  # noqa: ANN001
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._squeezes_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch


if interpreting():
    _fix_interpreter_index()
