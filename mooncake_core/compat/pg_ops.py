"""Input checks and reductions of ``mooncake.pg`` (CPU tensors; one-line errors)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["assign", "check_tensor", "check_tensors", "reduce_op", "reduce_tensors"]

_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
_BITWISE = ("BAND", "BOR", "BXOR")


def reduce_op(opts: Any, what: str) -> str:
    """The name of the reduction in ``opts`` (SUM when none), or one line refusing it."""
    if opts is None:
        return "SUM"
    op = getattr(opts.reduceOp, "op", opts.reduceOp)
    name = str(getattr(op, "name", op))
    if name not in _OPS:
        raise ValueError(
            f"mooncake.pg {what}: ReduceOp.{name} is not supported (supported: {', '.join(_OPS)})"
        )
    return name


def check_tensor(t: Any, what: str, op: str | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mooncake.pg {what}: a torch.Tensor is needed, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"mooncake.pg {what}: {t.device} tensor refused: this implementation moves CPU "
            "tensors only (no GPU data path); copy it to the CPU first"
        )
    if t.layout != torch.strided:
        raise ValueError(f"mooncake.pg {what}: {t.layout} tensors are not supported")
    if op in _BITWISE and (t.is_floating_point() or t.is_complex()):
        raise ValueError(
            f"mooncake.pg {what}: ReduceOp.{op} needs an integer or bool tensor, got {t.dtype}"
        )
    if op == "AVG" and not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"mooncake.pg {what}: ReduceOp.AVG needs a floating tensor, got {t.dtype}")


def check_tensors(tensors: Sequence[Any], what: str, op: str | None = None) -> None:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"mooncake.pg {what}: at least one tensor is needed")
    for t in tensors:
        check_tensor(t, what, op)
    first = tensors[0]
    for t in tensors[1:]:
        if op is not None and t.dtype != first.dtype:
            raise ValueError(f"mooncake.pg {what}: mixed dtypes {first.dtype} and {t.dtype}")


def assign(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` through NumPy where it has the dtype (single-threaded; see
    :func:`reduce_tensors`). ``src`` has ``dst``'s dtype and number of elements."""
    try:
        np.copyto(dst.detach().numpy(), src.numpy().reshape(dst.shape))
    except (TypeError, RuntimeError, ValueError):  # a dtype NumPy lacks, negative strides
        dst.copy_(src.view(dst.shape))


def reduce_tensors(parts: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce ``parts`` in the order given (every member passes them in rank order, so
    every member gets bit-identical results). NumPy does the arithmetic where it has the
    dtype: its loops are single-threaded, whereas torch's intra-op threads of several ranks
    on one host fight over the cores (a 1 MiB sum took 3x longer)."""
    try:
        arrays = [p.numpy() for p in parts]
    except (TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16, ...)
        return _reduce_torch(parts, op)
    acc = arrays[0].copy()
    fn = _NP[op]
    for a in arrays[1:]:
        fn(acc, a, out=acc)
    if op == "AVG":
        np.divide(acc, len(parts), out=acc)
    return torch.from_numpy(acc)


_NP: dict[str, Any] = {
    "SUM": np.add,
    "AVG": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}


def _reduce_torch(parts: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    acc = parts[0].clone()
    for p in parts[1:]:
        if op in ("SUM", "AVG"):
            acc.add_(p)
        elif op == "PRODUCT":
            acc.mul_(p)
        elif op == "MIN":
            acc = torch.minimum(acc, p)
        elif op == "MAX":
            acc = torch.maximum(acc, p)
        elif op == "BAND":
            acc.bitwise_and_(p)
        elif op == "BOR":
            acc.bitwise_or_(p)
        else:
            acc.bitwise_xor_(p)
    if op == "AVG":
        acc.div_(len(parts))
    return acc
