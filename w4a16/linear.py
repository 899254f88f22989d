"""`W4A16Linear`: a drop-in `nn.Linear` whose weight is stored in the shared 4-bit layout.

Buffers (all in the state dict, so a quantized model saves and loads with plain `state_dict`):

    qweight  int32 [N, K // 8]   the shared packed layout (w4a16.layout)
    scales   [N, K // G]         in the module's activation dtype; `module.to(dtype)` casts them with the bias
    zeros    uint8 [N, K // G]   raw zero points, asymmetric (uint4) only; symmetric (uint4b8) has no zeros buffer
    bias     [N]                 optional

`forward` calls the `w4a16::gemm` op with `self.backend` ("auto" by default: the hybrid rule of w4a16.dispatch).
"""

from __future__ import annotations

import torch
from torch import nn

from . import dispatch
from .layout import QuantizedWeight, check_group_size, check_nibbles, check_symmetric
from .quantize import quantize


class W4A16Linear(nn.Module):
    """y = x @ dequant(W)^T (+ bias); in_features = K, out_features = N."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = 128,
        symmetric: bool = True,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_group_size(group_size)
        check_symmetric(symmetric)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if in_features <= 0 or in_features % group_size:
            raise ValueError(f"in_features={in_features} must be a positive multiple of group_size={group_size}")
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.backend = backend
        groups = in_features // group_size
        # Placeholders until a state dict or from_quantized fills them: every nibble 8, scale 1 (a zero weight).
        self.register_buffer("qweight", torch.full((out_features, in_features // 8), 0x88888888 - 2**32,
                                                   dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("zeros", None if symmetric else
                             torch.full((out_features, groups), 8, dtype=torch.uint8, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in dispatch.BACKENDS:
            raise ValueError(f"backend must be one of {dispatch.BACKENDS}, got {value!r}")
        self._backend = value

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def format(self) -> str:
        return "uint4b8" if self.symmetric else "uint4"

    @classmethod
    def from_quantized(
        cls,
        qw: QuantizedWeight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        backend: str = "auto",
    ) -> W4A16Linear:
        """Wrap a QuantizedWeight; scales and bias are cast once to `dtype` (default: the scales' dtype)."""
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
        dtype = qw.dtype if dtype is None else dtype
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (qw.n,)):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a tensor of shape [N] = [{qw.n}], got {got}")
        module = cls(qw.k, qw.n, bias is not None, qw.group_size, qw.symmetric, dtype, device="meta", backend=backend)
        module.qweight = qw.qweight.clone()
        module.scales = qw.scales.to(dtype=dtype, copy=True)
        if qw.zeros is not None:
            module.zeros = qw.zeros.clone()
        if bias is not None:
            module.bias = bias.detach().to(device=qw.device, dtype=dtype, copy=True)
        return module

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = True, backend: str = "auto"
    ) -> W4A16Linear:
        """Round-to-nearest quantize an nn.Linear (w4a16.quantize); keeps its device and dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        check_group_size(group_size)
        weight = linear.weight.detach()
        if weight.device.type == "meta":
            raise ValueError("linear's weight is on the meta device: load its weights before quantizing")
        if weight.shape[1] % group_size:
            raise ValueError(
                f"in_features={weight.shape[1]} must be a multiple of group_size={group_size} to quantize this layer"
            )
        qw = quantize(weight, group_size, symmetric)
        return cls.from_quantized(qw, None if linear.bias is None else linear.bias.detach(), weight.dtype, backend)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # The kernels read zero points unchecked (a check per call would synchronise the device): refuse values
        # outside 0..15 once, here, rather than compute with them.
        zeros = state_dict.get(prefix + "zeros")
        if isinstance(zeros, torch.Tensor) and zeros.device.type != "meta":
            check_nibbles(zeros, f"{prefix}zeros")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def quantized_weight(self) -> QuantizedWeight:
        """The weight as a (validated) QuantizedWeight over this module's buffers."""
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.w4a16.gemm(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias, self.backend)

    def extra_repr(self) -> str:
        rule = self.backend
        if rule == "auto" and self.scales.device.type != "meta":
            rule = f"auto [{dispatch.describe_rule(self.scales.device, self.scales.dtype)}]"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, format={self.format}, dtype={self.scales.dtype}, backend={rule}"
        )
