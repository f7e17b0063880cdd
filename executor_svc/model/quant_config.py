"""A checkpoint's ``quantization_config`` as AutoAWQ / AutoGPTQ / GPTQModel / optimum write it, read into a
``QuantSpec`` (method, group size, desc_act, zero-point format, the modules that stay float, a 4-bit head) or refused
with the field and its value; and the tensor names each quantized linear has. How those tensors are unpacked and run:
quant.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # "awq" or "gptq"
    group_size: int  # -1: one group over all inputs
    desc_act: bool = False
    sym: bool = True
    zero_offset: int = 0  # added to stored zeros: 1 for the "gptq" (v1) checkpoint format
    keep_float: tuple[str, ...] = ()  # AWQ's modules_to_not_convert: modules whose names contain one stay float
    lm_head: bool = False  # GPTQ's lm_head: the head is 4-bit too (lm_head.qweight, ...; the embedding stays float)

    def quantizes(self, module: str) -> bool:
        return not any(name in module for name in self.keep_float)

    def describe(self) -> str:
        extra = f", desc_act={self.desc_act}, sym={self.sym}" if self.method == "gptq" else ""
        head = ", lm_head 4-bit" if self.lm_head else ""
        return f"{self.method} 4-bit, group {self.group_size}{extra}{head}"


def parse_quant_config(qc, where: str) -> QuantSpec:
    """quantization_config as AutoAWQ / AutoGPTQ / GPTQModel / optimum write it; anything else is refused
    with the field and its value."""
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: quantization_config = {qc!r} must be a JSON object")
    method = str(qc.get("quant_method", "")).lower()

    def refuse(name: str, why: str):
        raise ValueError(f"{where}: quantization_config.{name} = {qc.get(name)!r} is not supported ({why})")

    if method not in ("awq", "gptq"):
        refuse("quant_method", "4-bit awq (GEMM layout) and gptq weights load; other formats do not")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        refuse("bits" if "bits" in qc else "w_bit", "only 4-bit weights load")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group >= 8):
        refuse("group_size", "a positive group size (or -1)")
    if not isinstance(qc.get("lm_head", False), bool):
        refuse("lm_head", "must be true or false")
    if method == "awq":
        if qc.get("lm_head"):
            refuse("lm_head", "AutoAWQ never quantizes the head; a 4-bit lm_head loads from GPTQ checkpoints")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            refuse("version", "only the GEMM layout loads (AutoAWQ's default)")
        if qc.get("zero_point", True) is not True:
            refuse("zero_point", "AWQ without zero points is not loaded")
        keep = qc.get("modules_to_not_convert") or []
        if not isinstance(keep, list) or not all(isinstance(m, str) for m in keep):
            refuse("modules_to_not_convert", "must be a list of module names")
        return QuantSpec("awq", group, keep_float=tuple(keep))
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        refuse("checkpoint_format", "gptq and gptq_v2 load; marlin/bitblas repacks do not")
    if qc.get("is_marlin_format"):
        refuse("is_marlin_format", "marlin repacks do not load")
    if qc.get("modules_in_block_to_quantize"):
        refuse("modules_in_block_to_quantize", "partly quantized blocks are not loaded")
    if qc.get("dynamic"):
        refuse("dynamic", "per-module overrides are not loaded")
    for flag in ("desc_act", "sym"):
        if not isinstance(qc.get(flag, flag == "sym"), bool):
            refuse(flag, "must be true or false")
    return QuantSpec("gptq", group, desc_act=bool(qc.get("desc_act", False)), sym=bool(qc.get("sym", True)),
                     zero_offset=1 if fmt == "gptq" else 0, lm_head=qc.get("lm_head", False))


def quant_tensor_names(spec: QuantSpec) -> tuple[str, ...]:
    return ("qweight", "qzeros", "scales") + (("g_idx",) if spec.method == "gptq" else ())
