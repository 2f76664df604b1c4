"""Verify an exported bundle against the function it came from.

:func:`verify_bundle` loads the bundle as the server does (:func:`xlaserve.bundle.load_bundle`:
manifest, weights file, each module validated and compiled by PJRT), runs every compiled batch
size on seeded random inputs, runs the reference on the same inputs, and compares each output
element by element with ``numpy.allclose``'s rule, its absolute term scaled by the output's
magnitude: ``|module - reference| <= atol * scale + rtol * |reference|``, where ``scale`` is
``max(1, max |reference|)`` over that output (NaN equals NaN). An error is thus measured against
the size of the numbers the output holds: float32 rounding in a deep network whose logits reach
30 differs from the reference by about 30 times what it does where they stay near 1, and passes
the same default; a module that computes something else, a tampered weights file or a wrong
binding order still fail, before a server ever sees the bundle.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from xlaserve.export.spec import DTYPES, ExportError
from xlaserve.progress import Step

__all__ = [
    "DEFAULT_TOLERANCES",
    "OutputCheck",
    "Verification",
    "VerificationError",
    "compare",
    "output_scale",
    "sample_inputs",
    "tolerance",
    "verify_bundle",
]

#: (atol, rtol) per output dtype code when none is given; atol is a fraction of the output's
#: scale (:func:`output_scale`). They allow for reordered float arithmetic only: a few hundred
#: ulps of the type at most (bf16 keeps 8 significant bits, f16 11, f32 24), relative to the
#: largest value of the output. f32's 5e-5: two float32 implementations of a deep network (XLA's
#: and eager PyTorch's MobileNetV2) differ by up to 1.9e-5 of the scale, each about as far from
#: the float64 result. Integer and boolean outputs must be equal.
DEFAULT_TOLERANCES: Mapping[str, tuple[float, float]] = {
    "f64": (1e-12, 1e-12),
    "f32": (5e-5, 1e-5),
    "f16": (1e-3, 1e-3),
    "bf16": (1e-2, 1e-2),
}


class VerificationError(ExportError):
    """A module's output differs from the reference beyond the tolerance; ``verification`` holds
    every comparison."""

    def __init__(self, message: str, verification: Verification) -> None:
        super().__init__(message)
        self.verification = verification

    def summary(self) -> str:
        """One line: the bundle, the failing output whose error is the largest part of its
        scale, and how many others fail."""
        failed = sorted((c for c in self.verification.checks if not c.ok),
                        key=lambda c: c.max_abs_error / c.scale, reverse=True)
        more = f"; {len(failed) - 1} other output(s) fail too" if len(failed) > 1 else ""
        return (f"bundle {self.verification.bundle.name!r} does not match its source function:"
                f" {failed[0].line() if failed else 'no output checked'}{more}")


@dataclasses.dataclass(frozen=True, slots=True)
class OutputCheck:
    """One output of one module compared with the reference."""

    module: str               # model.b4.mlir, or model.mlir@b4 (a dynamic-batch module specialized)
    batch: int
    output: str
    dtype: str                # manifest code
    max_abs_error: float
    max_rel_error: float      # over the elements where the reference is not 0
    atol: float
    rtol: float
    mismatched: int           # elements outside atol * scale + rtol * |reference|
    elements: int
    scale: float = 1.0        # max(1, max |reference|): what atol is a fraction of

    @property
    def ok(self) -> bool:
        return self.mismatched == 0

    def line(self) -> str:
        verdict = "ok" if self.ok else f"FAILED: {self.mismatched} of {self.elements} elements outside"
        return (f"{self.module} {self.output} ({self.dtype}): max abs error {self.max_abs_error:.3g},"
                f" scale {self.scale:.3g} (error {self.max_abs_error / self.scale:.3g} of it),"
                f" max rel error {self.max_rel_error:.3g} (atol {self.atol:g} x scale, rtol {self.rtol:g})"
                f" {verdict}")


@dataclasses.dataclass(frozen=True, slots=True)
class Verification:
    """Every module's outputs compared with the reference, module by module."""

    bundle: Path
    checks: tuple[OutputCheck, ...]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def lines(self) -> list[str]:
        return [check.line() for check in self.checks]


def tolerance(dtype: str, atol: float | None = None, rtol: float | None = None) -> tuple[float, float]:
    """The (atol, rtol) an output of manifest dtype ``dtype`` is held to: ``atol``/``rtol`` when
    given, else :data:`DEFAULT_TOLERANCES` (0 for integer and boolean outputs)."""
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    return (default_atol if atol is None else float(atol), default_rtol if rtol is None else float(rtol))


def sample_inputs(specs: Sequence, batch: int, seed: int = 0) -> list[np.ndarray]:
    """Seeded random inputs for manifest tensor specs at ``batch``: floats standard normal,
    ``u8`` over its whole range, other integers in [0, 16) (small enough to index with),
    booleans half true. Anything with ``name``, ``dtype`` (code) and ``row_major(batch)``, or a
    manifest ``TensorDecl``, will do."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in specs:
        code = spec.dtype if isinstance(spec.dtype, str) else spec.dtype.code
        dtype = DTYPES[code]
        shape = spec.row_major(batch) if hasattr(spec, "row_major") else spec.row_major_shape(batch)
        if code == "b1":
            array = rng.random(shape) < 0.5
        elif code == "u8":
            array = rng.integers(0, 256, shape)
        elif np.issubdtype(dtype, np.integer):
            array = rng.integers(0, 16, shape)
        else:
            array = rng.standard_normal(shape)
        arrays.append(np.asarray(array).astype(dtype))
    return arrays


def output_scale(expected: np.ndarray) -> float:
    """``max(1, max |expected|)`` over the finite elements: the magnitude an output's absolute
    tolerance is scaled by. Never below 1, so an output of small numbers keeps the plain
    absolute tolerance."""
    exp = np.abs(np.asarray(expected).astype(np.float64))
    finite = exp[np.isfinite(exp)]
    return max(1.0, float(finite.max())) if finite.size else 1.0


def compare(expected: np.ndarray, found: np.ndarray, atol: float, rtol: float) -> tuple[float, float, int]:
    """(max abs error, max rel error, elements outside ``atol * scale + rtol * |expected|``),
    ``scale`` being :func:`output_scale` of ``expected``."""
    exp = np.asarray(expected).astype(np.float64)
    got = np.asarray(found).astype(np.float64)
    both_nan = np.isnan(exp) & np.isnan(got)
    error = np.where(both_nan, 0.0, np.abs(got - exp))
    error = np.where(np.isnan(error), np.inf, error)        # NaN on one side only
    bad = int(np.count_nonzero(error > atol * output_scale(exp) + rtol * np.abs(np.nan_to_num(exp))))
    nonzero = np.abs(exp) > 0
    rel = error[nonzero] / np.abs(exp[nonzero]) if nonzero.any() else np.zeros(0)
    return (float(error.max()) if error.size else 0.0, float(rel.max()) if rel.size else 0.0, bad)


def verify_bundle(
    bundle: str | Path,
    reference: Callable[..., Sequence[np.ndarray]],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    backend: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> Verification:
    """Run each module of ``bundle`` and ``reference(*inputs)`` on the same seeded inputs and
    compare every output (see the module docstring for the rule and :func:`tolerance` for the
    defaults). ``reference`` returns the outputs in ``executable_outputs`` order.

    Returns the :class:`Verification` when every output is within tolerance. Otherwise raises
    :class:`VerificationError` whose message lists each failing output of each module with its
    largest errors. A bundle that does not load (its modules disagree with its manifest or
    weights) raises the loader's :class:`xlaserve.errors.BundleError`. ``progress`` hears one
    :class:`~xlaserve.progress.Step` per compiled module and one per output compared.
    """
    from xlaserve.bundle import load_bundle
    from xlaserve.runtime.pjrt import Device

    bundle = Path(bundle)
    device = Device(backend)
    model = load_bundle(bundle, 1, device, progress=progress)
    weights = list(model.weights.read()) if model.weights is not None else []
    specs = model.manifest.executable_inputs
    checks = []
    total = len(model.modules) * len(model.manifest.executable_outputs)
    for batch, module in sorted(model.modules.items()):
        arrays = sample_inputs(specs, batch, seed + batch)
        found = device.execute(module.executable, [*weights, *arrays])
        expected = [np.asarray(x) for x in reference(*arrays)]
        declared = model.manifest.executable_outputs
        if len(expected) != len(declared):
            raise ExportError(f"the reference returned {len(expected)} outputs, the bundle declares {len(declared)}")
        for decl, want, got in zip(declared, expected, found):
            if want.shape != got.shape:
                raise ExportError(f"{module.label} {decl.name}: the module returns shape {list(got.shape)},"
                                  f" the reference {list(want.shape)}")
            atol_, rtol_ = tolerance(decl.dtype.code, atol, rtol)
            abs_err, rel_err, bad = compare(want, got, atol_, rtol_)
            check = OutputCheck(module.label, batch, decl.name, decl.dtype.code, abs_err, rel_err,
                                atol_, rtol_, bad, int(want.size), output_scale(want))
            checks.append(check)
            if progress is not None:
                progress(Step("verify", len(checks), total, f"{bundle.name}: verify {check.line()}"))
    verification = Verification(bundle, tuple(checks))
    if not verification.ok:
        failed = [check.line() for check in checks if not check.ok]
        raise VerificationError(
            f"bundle {bundle.name!r} does not match its source function:\n  " + "\n  ".join(failed),
            verification,
        )
    return verification
