"""fp32 matmul precision: TF32 tensor cores for ``32-true`` training on CUDA GPUs.

torch's default (``"highest"``) runs fp32 matmuls on an H100's CUDA cores, about 1/7 of the TF32
tensor-core rate (NVIDIA H100 SXM datasheet: 67 vs 495 dense TFLOP/s); TF32 keeps fp32 storage and
accumulation with a 10-bit mantissa for the products. Under ``bf16-mixed`` / ``bf16-true`` the
GEMMs run in bf16 and this setting changes nothing that matters, so it is left alone there, as it
is on CPU (no TF32) and whenever the user turned it off (``tf32=false``: exact fp32, e.g. for
parity checks between layouts on a GPU).
"""

from __future__ import annotations

FP32_PRECISIONS = ("32-true", "32")


def float32_matmul_precision(precision: str, device_type: str, tf32: bool = True) -> str | None:
    """The ``torch.set_float32_matmul_precision`` value a run should use, or None to leave torch's.

    ``"high"`` (TF32 matmuls; cuDNN convolutions already default to TF32) for fp32 training on
    CUDA with ``tf32`` on; None otherwise.
    """
    if tf32 and device_type == "cuda" and str(precision) in FP32_PRECISIONS:
        return "high"
    return None
