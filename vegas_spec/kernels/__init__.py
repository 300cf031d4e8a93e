"""Triton kernels behind the compute seams (the attention backend's and the ops'), one kernel
(and its host wrapper) per file.

  paged_attention   causal attention over the paged cache for 1..n query rows, with the
                    selection scores of chosen rows fused into the same pass (verify, prefill)
  sparse_attention  attention over listed positions plus the recent range (draft steps), with
                    a one-row step's RoPE and KV store done in the same kernel
  split_merge       merge of the key splits of both (flash-decoding), shared tile helpers
  rope_store        RoPE on a step's q and k, with k and v written into their cache slots
  store_kv          a step's new K/V into their cache slots (the seam's store without RoPE)
  slots             a step's cache slots from its positions and page table
  rms_norm          RMSNorm, fused with the residual add before it
  silu_mul          SiLU(gate) * up of the fused gate/up projection (or gpt-oss's clamped
                    SwiGLU)
  topk              top-k positions per (layer, sequence, group) by a threshold search (selection),
                    quest's chosen pages expanded to their tokens in the same kernel
  quest_scores      quest's page scores for a draft row, from the pages' min/max keys
  exact_matmul      a projection whose rows do not depend on the number of rows (exact mode)
  route             a mixture of experts' routing: each token's softmax, top-k experts and
                    their renormalised weights
  fused_moe         a mixture of experts: the tokens grouped by expert, two grouped matmuls
                    that stream each hit expert's weights once a block of its tokens
  skinny_matmul     a projection of few rows that streams its weights once (the draft
                    steps' FP8, INT8 and INT4 weights)
  sample            a token per row by argmax(p / E) with counter-based Exp(1) noise, in one
                    read of p; the draws' keys and uniforms; the candidates' probabilities
                    after temperature, top-k and top-p (sampled decoding, drafting and
                    verification)

Every kernel has a plain-PyTorch reference that is its test oracle:
`vegas_spec.attention.torch_backend` (attention, KV store),
`vegas_spec.cache.slots_of` (slots), `vegas_spec.ops` (`rms_norm`, `add_rms_norm`,
`silu_mul`, `clamped_swiglu`, `apply_rope`, `topk_positions`, `quest_page_scores_ref`,
`route`, `moe_experts`),
`vegas_spec.sampling` (`draw_keys`, `uniform`, `exponential_argmax_ref`,
`candidate_probs_ref`: sample) and `torch.nn.functional.linear`
(exact_matmul, skinny_matmul). On a machine without CUDA the kernels run on CPU tensors under
Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is first imported), patched below
where it departs from compiled Triton and where it redoes work at every device-function call.

Tuning: each kernel module keeps every tuned number of its launches (tiles, warps, stages,
split rules) in one table, `TUNING`, keyed by device class (`device_class`: "sm90" for a
CUDA device of compute capability 9.0, "interpreter" for CPU tensors; "default" for a GPU
the table does not list), each entry a frozen dataclass of that kernel's fields, and its
`tuning(device)` returns the entry a launch on that device reads. A new card is one new
entry per table. The host wrappers read the table at every launch; `tuned` replaces fields
for a block of code, the one way the benchmarks' tile sweeps try other settings. What was
tried and measured is in docs/kernel-notes.md."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

Entry = TypeVar("Entry")


def device_class(device: torch.device) -> str:
    """The key of `device` in the kernels' tuning tables: "sm" and the compute capability of a
    CUDA device ("sm90" for an H100 or H200), "interpreter" for any other device (CPU
    tensors, which only Triton's interpreter runs)."""
    if device.type != "cuda":
        return "interpreter"
    return _cuda_class(device.index if device.index is not None else _current_cuda())


def _current_cuda() -> int:
    import torch

    return torch.cuda.current_device()


@functools.lru_cache(maxsize=16)
def _cuda_class(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def for_device(table: Mapping[str, Entry], device: torch.device) -> Entry:
    """`table`'s entry for `device`: its class's (`device_class`), else "default" (a GPU the
    table does not list)."""
    entry = table.get(device_class(device))
    return table["default"] if entry is None else entry


@functools.lru_cache(maxsize=16)
def sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The SMs of the CUDA `device` (the current one when it names no index)."""
    return sm_count(device.index if device.index is not None else _current_cuda())


# Zeroed counters by device, for the kernels whose last program of a group finishes the
# group's work (skinny_matmul's split sum, sparse_attention's merge); every launch leaves them
# at zero, so launches on a stream share them. A buffer is never freed: a CUDA graph captured
# with it keeps its address (a larger one, should a launch need more, goes beside it).
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(groups: int, device: torch.device) -> torch.Tensor:
    """At least `groups` zeroed int32 counters on `device` (65,536 at first: a column block
    of 16 columns of a 1M-entry vocabulary), made once and kept for good."""
    import torch

    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < groups:
        held.append(torch.zeros(max(groups, 1 << 16), dtype=torch.int32, device=device))
    return held[-1]


@contextlib.contextmanager
def tuned(module: ModuleType, **settings: object) -> Iterator[None]:
    """Inside the block, `module`'s tuning holds the given settings; restored after it. A
    keyword names a field of the module's tuning, set in every entry of its `TUNING` table
    whatever the device class (e.g. `tuned(paged_attention, score_tiles={64: ...})`); an
    unknown name, or a module without a table, is a KeyError. Launches read the table, so a
    CUDA graph captured inside the block keeps the tiles it was captured with."""
    table: dict[str, object] = getattr(module, "TUNING", {})  # none: every name unknown
    fields = {field.name for entry in table.values() for field in dataclasses.fields(entry)}
    unknown = [name for name in settings if name not in fields]
    if unknown:
        raise KeyError(f"{module.__name__} has no tuning field {', '.join(unknown)}")
    saved = dict(table)
    try:
        for key, entry in saved.items():
            table[key] = dataclasses.replace(entry, **settings)
        yield
    finally:
        table.clear()
        table.update(saved)


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


def _fix_interpreter_bf16() -> None:
    """Triton <= 3.6's interpreter casts float32 to bfloat16 by truncation, where compiled
    Triton (cvt.rn), CUDA and torch round to nearest even, and it flushes some bfloat16
    subnormals when widening them: bf16 results would be off by up to an ulp, and no bf16
    kernel could be checked bit for bit. Convert as torch does (c10::round_to_nearest_even,
    NaN kept NaN; widening is exact)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, "_exact_bf16", False):
        return

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202
        pair = (src.dtype.scalar, dst_type.scalar)
        if pair == (tl.bfloat16, tl.float32):
            bits = np.asarray(src.data).view(np.uint16).astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), dst_type.scalar)
        if pair == (tl.float32, tl.bfloat16):
            data = np.asarray(src.data, dtype=np.float32)
            bits = data.view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
            rounded = np.where(np.isnan(data), (bits >> 16) | 0x40, rounded)
            return interpreter.TensorHandle(rounded.astype(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._exact_bf16 = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl


def _fix_interpreter_dot() -> None:
    """Two repairs of Triton <= 3.6's interpreter `tl.dot` (NumPy's matmul):
    - it multiplies bfloat16 tiles as the integers of their bits (NumPy has no bfloat16; the
      tiles are uint16 arrays): they are widened to float32 first, which is exact, as the
      tensor cores' bf16 products with a float32 sum are;
    - a row's result depends on where the row sits in the tile on some CPUs (OpenBLAS's
      AVX2 sgemm kernels), where a GPU's tensor cores compute every row alike, so exact mode's
      row invariance could not be checked on such a CPU: floating-point tiles are multiplied
      as products summed over K in order, the same arithmetic for every row."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_row_invariant", False):
        return

    def widen(handle):  # noqa: ANN001, ANN202
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.asarray(handle.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        a, b = widen(a), widen(b)
        acc = np.asarray(d.data)
        if a.data.ndim == b.data.ndim == 2 and a.dtype.scalar.is_floating() \
                and b.dtype.scalar.is_floating() and a.dtype.scalar.primitive_bitwidth > 8 \
                and b.dtype.scalar.primitive_bitwidth > 8 and acc.dtype.kind == "f":
            products = a.data.astype(acc.dtype)[:, :, None] * b.data.astype(acc.dtype)[None]
            return interpreter.TensorHandle(products.sum(axis=1, dtype=acc.dtype) + acc,
                                            d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._row_invariant = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def _patch_once_per_launch() -> None:
    """Triton <= 3.6's interpreter patches `triton.language` at every launch and anew at every
    call of a device function inside it (`_patch_lang`), listing each module's members with
    `inspect.getmembers` each time; the nested patches are never restored and change nothing,
    the launch around them having patched the same modules. That was a sixth of an
    interpreted launch's time in our kernels. Now a device function whose modules the launch
    in progress patched runs without patching them again, and each module's builtins are
    listed and wrapped once (outside any launch, where its members are the originals; the
    wrappers, as `_patch_attr` makes them, hold a stateless `TritonSemantic` of the builder):
    what is patched, and when it is restored, is as before. Which language modules a device
    function's globals hold is kept per module while its globals keep their size."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_once_per_launch", False):
        return
    launch: set[int] | None = None  # the modules patched in the launch in progress
    # a module's builtins wrapped for a builder, by (module, builder)
    wrapped: dict[tuple[int, int], list[tuple[str, object]]] = {}

    # the language modules of each module's globals (held, so that their id stays theirs),
    # while they hold as many names
    seen: dict[int, tuple[dict, int, frozenset[int]]] = {}

    def languages(fn) -> frozenset[int]:  # noqa: ANN001
        names = fn.__globals__
        known = seen.get(id(names))
        if known is None or known[0] is not names or known[1] != len(names):
            known = seen[id(names)] = (names, len(names), frozenset(
                id(v) for v in names.values() if inspect.ismodule(v) and v in (tl, tl.core)))
        return known[2]

    def wrap(member, semantic):  # noqa: ANN001, ANN202 (as interpreter._patch_attr wraps)
        return lambda *args, **kwargs: member(
            *args, **{k: v for k, v in kwargs.items() if k != "_semantic"}, _semantic=semantic)

    def patch_builtin(pkg, builder, scope) -> None:  # noqa: ANN001
        key = (id(pkg), id(builder))
        members = wrapped.get(key)
        if members is None:
            semantic = interpreter.TritonSemantic(builder)
            members = [(n, wrap(m, semantic)) for n, m in inspect.getmembers(pkg)
                       if tl.core.is_builtin(m)]
            if launch is None:  # outside a launch the members are the originals: keep them
                wrapped[key] = members
        for name, member in members:
            scope.set_attr(pkg, name, member)

    def patch_lang(fn):  # noqa: ANN001, ANN202
        nonlocal launch
        langs = languages(fn)
        if launch is not None:  # a device function inside a launch
            if langs <= launch:
                return interpreter._LangPatchScope()
            # a module the launch did not patch (triton.language.core, in `tl.sum`'s
            # module): patched as before, never restored, so patched for the rest of the launch
            scope = original(fn)
            launch |= langs
            return scope
        scope = original(fn)  # a launch: restored when its grid has run
        launch = set(langs)
        restore = scope.restore

        def restore_and_end() -> None:
            nonlocal launch
            launch = None
            restore()

        scope.restore = restore_and_end
        return scope

    patch_lang._once_per_launch = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    interpreter._patch_builtin = patch_builtin


def _cache_interpreter_dtypes() -> None:
    """Triton <= 3.6's interpreter maps a Triton dtype to NumPy's (`_get_np_dtype`) by
    building a dictionary of 19 NumPy dtypes at every call, several times an operation (a
    fifteenth of an interpreted launch's time in our kernels): the answer is kept per element
    type, which is all it depends on (a block's dtype is its element type's, any pointer's is
    uint64)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._get_np_dtype
    if getattr(original, "_cached", False):
        return
    known: dict[object, object] = {}

    def get_np_dtype(tt_dtype):  # noqa: ANN001, ANN202
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):  # unhashable
            return original(key)
        found = known.get(key)
        if found is None:
            found = known[key] = original(key)
        return found

    get_np_dtype._cached = True  # type: ignore[attr-defined]
    interpreter._get_np_dtype = get_np_dtype


def _share_interpreter_block_types() -> None:
    """Triton <= 3.6's front end builds a new `block_type` for every value an interpreted
    operation makes (its shape a `tl.tuple` with a type and a name string of its own), and a
    tensor's shape anew from it as a tuple of constexprs: a tenth of an interpreted launch's
    time in our kernels. A block type is never changed once made, so one instance serves
    every (element type, shape), and a tensor takes its shape, size and scalar type from
    those its type computed the first time. Two types, compared at every operation, are
    first compared by identity (most often they are one object)."""
    import triton.language as tl

    core = tl.core
    block, tensor = core.block_type, core.tensor
    if getattr(block, "_shared", False):
        return
    block_init, tensor_init = block.__init__, tensor.__init__
    known: dict[object, object] = {}

    def key_of(ty):  # noqa: ANN001, ANN202 (pointer types are unhashable)
        if isinstance(ty, core.pointer_type):
            return ("pointer", key_of(ty.element_ty), ty.address_space, ty.const)
        return ty

    def new(cls, element_ty, shape):  # noqa: ANN001, ANN202
        if cls is not block:
            return object.__new__(cls)
        try:
            key = (key_of(element_ty),
                   tuple(s.value if isinstance(s, core.constexpr) else s for s in shape))
            found = known.get(key)
        except TypeError:  # a shape or type that does not hash: made as before
            return object.__new__(cls)
        if found is None:
            found = known[key] = object.__new__(cls)
            block_init(found, element_ty, shape)
            found._made = True
        return found

    def init(self, element_ty, shape) -> None:  # noqa: ANN001
        if not self.__dict__.get("_made"):
            block_init(self, element_ty, shape)

    def init_tensor(self, handle, type) -> None:  # noqa: A002, ANN001
        own = getattr(type, "__dict__", None)
        made = None if own is None else own.get("_tensor")
        if made is None:
            tensor_init(self, handle, type)
            if own is not None:
                type._tensor = (self.shape, self.numel, self.dtype)
            return
        self.handle, self.type = handle, type
        self.shape, self.numel, self.dtype = made

    block.__new__ = staticmethod(new)
    block.__init__ = init
    tensor.__init__ = init_tensor
    block._shared = True
    equal = core.dtype.__eq__  # types are compared at every operation, mostly with themselves
    core.dtype.__eq__ = lambda self, other: self is other or equal(self, other)


if interpreting():
    _fix_interpreter_index()
    _cache_interpreter_dtypes()
    _share_interpreter_block_types()
    _fix_interpreter_bf16()
    _fix_interpreter_dot()
    _patch_once_per_launch()
