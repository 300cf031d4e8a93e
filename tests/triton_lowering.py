"""Every Triton launch the tests make under the interpreter, compiled's first stage too.

Triton's interpreter runs a kernel as Python: code that compiled Triton rejects (a return
inside a constexpr branch followed by another, shapes the code generator infers otherwise, an
unsupported construct) runs there and passes. So on a machine without CUDA, `Recorder` notes
each launch of a package kernel (its constexpr values, its other arguments' types, its launch
options) and its twin as a GPU makes it (`compiled_twin`), and a child process without
TRITON_INTERPRET lowers each distinct one to Triton IR for sm_90 with the NVIDIA backend's own
code generator (`ASTSource.make_ir`: no GPU, no ptxas), the step where such code fails on the
GPU. The first twin of each kernel and choice of its GPU-only settings (`GPU_SETTINGS`) is
compiled whole, to a cubin (`lower`'s `whole`: inline PTX and libdevice are checked there
only). A failure names the kernel, its constexprs and the compiler's message.

Run as a script, this file is that child: it reads pickled batches of launches from stdin and
answers each with the list of failures."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

# (kernel module, kernel name, {parameter: (Triton type or None for a constexpr, value)},
#  launch options)
Launch = tuple[str, str, dict[str, tuple[str | None, Any]], dict[str, Any]]
PACKAGE = "vegas_spec."


def _send(stream: BinaryIO, value: Any) -> None:
    data = pickle.dumps(value)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the lowering process ended")
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def describe(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Launch:
    """One launch of kernel `fn` as the lowering reads it: a constexpr parameter's value, the
    Triton type (`mangle_type`: "*bf16", "i32", "tensordesc<fp32[4, 32]>", ...) of any other
    (its value does not change the code: launches that differ only there are one), and the
    options (num_warps, ...) among the keywords."""
    from triton.runtime.jit import mangle_type

    signature = inspect.signature(fn)
    names = set(signature.parameters)
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    params: dict[str, tuple[str | None, Any]] = {}
    for name, value in bound.arguments.items():
        if "constexpr" in str(signature.parameters[name].annotation):
            params[name] = (None, value)
            continue
        kind = mangle_type(value)  # "constexpr" for None
        params[name] = (None if kind == "constexpr" else kind, None)
    options = {k: v for k, v in kwargs.items() if k not in names}
    return fn.__module__, fn.__name__, params, options


# constexprs a launcher sets only where the kernel is compiled (libdevice, PTX, rounding
# instructions the interpreter lacks): each launch that has one is lowered as a GPU makes it too
COMPILED_ONLY = ("MUL_RN", "LIBDEVICE_EXP", "MEAN_BY_RECIPROCAL", "E2M1_PTX_DECODE")


# the constexprs that choose code only a GPU runs: a twin of each kernel and choice of them
# is compiled whole
GPU_SETTINGS = (*COMPILED_ONLY, "INT8_PTX", "FP4_DOT")


def compiled_twin(launch: Launch) -> Launch | None:
    """`launch` as a GPU would make it (`COMPILED_ONLY` on; INT8 tiles in a float16 dot
    converted by PTX; MXFP4 experts decoded and dotted as bfloat16 rows' scaled dot), None
    where that is `launch` itself."""
    module, name, params, options = launch
    twin = dict(params)
    for setting in COMPILED_ONLY:
        if setting in twin:
            twin[setting] = (None, True)
    if "INT8_PTX" in twin and twin["HALF_DOT"][1] and twin["w_ptr"][0] == "*i8":
        twin["INT8_PTX"] = (None, True)
    if "FP4_DOT" in twin and twin["FP4"][1] and twin["FP4_DOT"][1] == 0:
        twin["FP4_DOT"], twin["a_ptr"] = (None, 1), ("*bf16", None)
    return None if twin == params else (module, name, twin, options)


def _key(launch: Launch) -> tuple[Any, ...]:
    module, name, params, options = launch
    return (module, name, tuple((k, kind, repr(v)) for k, (kind, v) in params.items()),
            tuple(sorted(options.items())))


class Recorder:
    """Notes the package's interpreted launches (`start`..`stop`) and lowers the new distinct
    ones in one child process kept for the session (`check`)."""

    def __init__(self, prefix: str = PACKAGE) -> None:
        self.prefix = prefix  # the modules whose kernels are noted
        # each launch, and whether to compile it whole (`lower`)
        self.pending: dict[tuple[Any, ...], tuple[Launch, bool]] = {}
        self.seen: set[tuple[Any, ...]] = set()
        # each kernel's GPU settings (`GPU_SETTINGS`) with a twin compiled whole
        self.whole: set[tuple[Any, ...]] = set()
        self.child: subprocess.Popen[bytes] | None = None
        self.original: Callable[..., Any] | None = None

    def start(self) -> None:
        from triton.runtime import interpreter

        self.original = original = interpreter.InterpretedFunction.run
        recorder = self

        def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:  # noqa: ANN001
            if self.fn.__module__.startswith(recorder.prefix):
                launch = describe(self.fn, args, kwargs)
                recorder.note(launch, whole=False)
                twin = compiled_twin(launch)
                if twin is not None:
                    kind = (*twin[:2], *((k, v) for k, (_, v) in twin[2].items()
                                         if k in GPU_SETTINGS))
                    recorder.note(twin, whole=kind not in recorder.whole)
                    recorder.whole.add(kind)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        interpreter.InterpretedFunction.run = run

    def note(self, launch: Launch, whole: bool) -> None:
        key = _key(launch)
        if key not in self.seen and key not in self.pending:
            self.pending[key] = (launch, whole)

    def stop(self) -> None:
        from triton.runtime import interpreter

        if self.original is not None:
            interpreter.InterpretedFunction.run = self.original
        if self.child is not None:
            self.child.stdin.close()  # type: ignore[union-attr]
            self.child.wait(timeout=60)

    def check(self) -> list[tuple[str, str]]:
        """The failures (the launch, the compiler's message) of the launches noted since the
        last check, each lowered once a session."""
        if not self.pending:
            return []
        if self.child is None:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            self.child = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env)
        batch = list(self.pending.values())
        self.seen.update(self.pending)
        self.pending.clear()
        _send(self.child.stdin, batch)  # type: ignore[arg-type]
        return _receive(self.child.stdout)  # type: ignore[arg-type]


@functools.cache
def _backend() -> Any:
    """The NVIDIA backend's compiler for sm_90 (one a process)."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    return backends["nvidia"].compiler(GPUTarget("cuda", 90, 32))


def lower(launch: Launch, whole: bool = False) -> tuple[str, str] | None:
    """None where `launch` lowers to Triton IR for sm_90, else the launch and the compiler's
    message. `whole`: compiled to a cubin instead (PTX, ptxas: what inline PTX and libdevice
    need to be checked; about a second and a half, where lowering takes a few hundredths)."""
    import triton
    from triton._C.libtriton import ir
    from triton.compiler.compiler import ASTSource

    module, name, params, options = launch
    kernel = getattr(importlib.import_module(module), name)
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in kernel.params:
        kind, value = params[param.name]
        if param.is_constexpr or kind is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = kind
    backend = _backend()
    source = ASTSource(kernel, signature, constexprs)
    try:
        if whole:
            triton.compile(source, target=backend.target, options=options)
        else:
            parsed = backend.parse_options(options)
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            source.make_ir(backend.target, parsed, backend.get_codegen_implementation(parsed),
                           backend.get_module_map(), context)
    except Exception as error:  # noqa: BLE001 (the compiler's message is the report)
        root = error
        while root.__cause__ is not None:  # the compiler's errors nest a call's in its caller's
            root = root.__cause__
        cause = f"\n{type(root).__name__}: {root}" if root is not error else ""
        return f"{module}.{name} with {constexprs}, {options}", f"{error}{cause}"
    return None


def main() -> None:
    # the answers go down a copy of stdout; what the compiler's tools print, to stderr
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    while True:
        try:
            batch = _receive(sys.stdin.buffer)
        except EOFError:
            return
        failures = (lower(launch, whole) for launch, whole in batch)
        _send(answers, [f for f in failures if f is not None])


if __name__ == "__main__":
    main()
