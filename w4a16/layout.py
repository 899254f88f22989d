"""The packed int4 weight shared by every kernel, and its container `QuantizedWeight`.

Layout (one tensor, read by both the skinny decode kernel and the Triton GEMM):

    qweight  int32 [N, K // 8]   row n = output feature n, packed along K, 8 nibbles per word
    scales   fp16/bf16/fp32 [N, K // G]   one scale per group of G consecutive k
    zeros    uint8 [N, K // G], raw zero points 0..15; None means symmetric uint4b8 (z = 8)

    dequant(W)[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]

In-word order ("shuffle"): the nibble for k-offset j (0..7) sits at bit shift (j // 2) * 4 + (j % 2) * 16,
i.e. slot s (bits 4s..4s+3) holds k-offset SHUFFLE_ORDER[s] = [0, 2, 4, 6, 1, 3, 5, 7][s]. Why: the mask
(word >> 4p) & 0x000F000F yields k = 2p in the low 16-bit lane and k = 2p + 1 in the high lane, so a kernel
builds a half2/bf16x2 pair in natural K order with one shift, one mask and one OR.
"""

from __future__ import annotations

import torch

GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = 8
NIBBLES_PER_WORD = 8

# slot s of a word holds element SHUFFLE_ORDER[s] of its 8-element run (see the module docstring).
SHUFFLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# slot s holds element s: the order of GPTQ and compressed-tensors checkpoints.
SEQUENTIAL_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_nibbles(q: torch.Tensor, name: str) -> None:
    if q.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor of dtype {', '.join(map(str, _INTEGER_DTYPES))} with "
                        f"values 0..15, got dtype {q.dtype}")
    if q.device.type == "meta":  # no values to check (a model built on the meta device, filled later)
        return
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"{name} values must lie in 0..15, got min {int(q.min())} and max {int(q.max())}")


def pack_nibbles(q: torch.Tensor, order: tuple[int, ...], name: str = "q") -> torch.Tensor:
    """Pack the last dim of an integer tensor (values 0..15) 8 per int32 word; slot s gets element order[s]."""
    check_nibbles(q, name)
    if q.dim() < 1 or q.shape[-1] % NIBBLES_PER_WORD:
        raise ValueError(f"{name}'s last dim must be a multiple of 8, got shape {tuple(q.shape)}")
    runs = q.to(torch.int64).reshape(*q.shape[:-1], q.shape[-1] // NIBBLES_PER_WORD, NIBBLES_PER_WORD)
    words = torch.zeros(runs.shape[:-1], dtype=torch.int64, device=q.device)
    for slot, element in enumerate(order):
        words |= runs[..., element] << (4 * slot)
    # Reinterpret the unsigned 32-bit pattern as int32 (two's complement) without relying on overflow casts.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_nibbles(words: torch.Tensor, order: tuple[int, ...], name: str = "qweight") -> torch.Tensor:
    """Inverse of `pack_nibbles`: int32 [..., L] -> uint8 [..., 8 L]."""
    if words.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (8 packed nibbles per word), got dtype {words.dtype}")
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*words.shape, NIBBLES_PER_WORD, dtype=torch.uint8, device=words.device)
    for slot, element in enumerate(order):
        out[..., element] = ((unsigned >> (4 * slot)) & 0xF).to(torch.uint8)
    return out.reshape(*words.shape[:-1], words.shape[-1] * NIBBLES_PER_WORD)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integer [N, K] with values 0..15 -> int32 [N, K // 8] in the shuffle order."""
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [N, K], got shape {tuple(q.shape)}")
    return pack_nibbles(q, SHUFFLE_ORDER, "q")


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] in the shuffle order -> uint8 [N, K] with values 0..15."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [N, K // 8], got shape {tuple(qweight.shape)}")
    return unpack_nibbles(qweight, SHUFFLE_ORDER, "qweight")


def check_group_size(group_size: int) -> None:
    # An int, not merely equal to one: 128.0 would pass `in GROUP_SIZES` and then reach shapes and kernels as a float.
    # (A SymInt is an int under torch.compile with dynamic shapes.)
    if isinstance(group_size, bool) or not isinstance(group_size, (int, torch.SymInt)):
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r} ({type(group_size).__name__})")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def check_symmetric(symmetric: bool) -> None:
    # Strictly a bool: any non-empty string, "no" and "false" included, would otherwise read as true.
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be True (uint4b8) or False (uint4 with zero points), got {symmetric!r}")


def _as_zero_points(zeros: torch.Tensor) -> torch.Tensor:
    if zeros.dtype.is_floating_point:
        if not torch.equal(zeros, zeros.round()):
            raise ValueError("zeros must be integer-valued zero points 0..15, got non-integer floats")
        zeros = zeros.to(torch.int64)
    check_nibbles(zeros, "zeros")
    return zeros.to(torch.uint8)


class QuantizedWeight:
    """A 4-bit weight in the shared layout (see the module docstring); validated on construction.

    qweight: int32 [N, K // 8] (shuffle order). scales: [N, K // G], fp16/bf16/fp32 (kernels want the
    activation dtype). zeros: None (symmetric uint4b8, z = 8) or integer-valued [N, K // G] in 0..15. The given
    tensors are held, not copied, where they are contiguous (and zeros uint8): changing them afterwards changes the
    weight, past the checks made here.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None = None,
        group_size: int = 128,
    ) -> None:
        if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int32:
            got = qweight.dtype if isinstance(qweight, torch.Tensor) else type(qweight).__name__
            raise TypeError(f"qweight must be an int32 tensor [N, K // 8], got {got}")
        if qweight.dim() != 2 or qweight.shape[0] == 0 or qweight.shape[1] == 0:
            raise ValueError(f"qweight must be a non-empty 2-D [N, K // 8] tensor, got shape {tuple(qweight.shape)}")
        check_group_size(group_size)
        n, k = qweight.shape[0], qweight.shape[1] * NIBBLES_PER_WORD
        if k % group_size:
            raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
        groups = k // group_size
        if not isinstance(scales, torch.Tensor) or scales.dtype not in _SCALE_DTYPES:
            got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise TypeError(f"scales must be a float16, bfloat16 or float32 tensor, got {got}")
        if tuple(scales.shape) != (n, groups):
            raise ValueError(f"scales must have shape [N, K // G] = [{n}, {groups}], got {tuple(scales.shape)}")
        if scales.device != qweight.device:
            raise ValueError(f"scales are on {scales.device} but qweight is on {qweight.device}")
        if zeros is not None:
            if not isinstance(zeros, torch.Tensor):
                raise TypeError(f"zeros must be a tensor or None, got {type(zeros).__name__}")
            if tuple(zeros.shape) != (n, groups):
                raise ValueError(f"zeros must have shape [N, K // G] = [{n}, {groups}], got {tuple(zeros.shape)}")
            if zeros.device != qweight.device:
                raise ValueError(f"zeros are on {zeros.device} but qweight is on {qweight.device}")
            zeros = _as_zero_points(zeros).contiguous()
        self.qweight = qweight.contiguous()
        self.scales = scales.contiguous()
        self.zeros = zeros
        self.group_size = group_size

    @property
    def n(self) -> int:
        return self.qweight.shape[0]

    @property
    def k(self) -> int:
        return self.qweight.shape[1] * NIBBLES_PER_WORD

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def dtype(self) -> torch.dtype:
        """The scales' dtype, which the kernels expect to equal the activation dtype."""
        return self.scales.dtype

    @property
    def format(self) -> str:
        return "uint4b8" if self.symmetric else "uint4"

    def zero_points(self) -> torch.Tensor:
        """The zero points as uint8 [N, K // G], materialised (8 everywhere) for symmetric weights."""
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, SYMMETRIC_ZERO, dtype=torch.uint8)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> QuantizedWeight:
        """The weight on `device`, with scales cast to `dtype` (the activation dtype) when given; `qw.to(torch.float16)`
        works as for tensors. As with Tensor.to, a tensor already on that device (and dtype) is shared, not copied."""
        if isinstance(device, torch.dtype) and dtype is None:
            device, dtype = None, device
        scales = self.scales.to(device=device, dtype=dtype)
        zeros = None if self.zeros is None else self.zeros.to(device)
        return QuantizedWeight(self.qweight.to(device), scales, zeros, self.group_size)

    def nbytes(self) -> int:
        """Bytes a kernel must read: packed weights, scales and zero points."""
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight(N={self.n}, K={self.k}, group_size={self.group_size}, format={self.format}, "
            f"scales={self.scales.dtype}, device={self.device})"
        )
