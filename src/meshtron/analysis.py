"""What a compiled step communicates, and what Megatron's paper says it should -- the names of
:mod:`meshtron.hlo` (the compiled program, read from its HLO), :mod:`meshtron.megatron` (the
papers' formulas) and :mod:`meshtron.units` under their former common name, which keeps working.
"""

from meshtron.hlo.collectives import (
    COLLECTIVE_KINDS,
    Collective,
    bytes_by_axes,
    collectives,
    count_by,
    iota_device_groups,
    ring_wire_bytes,
)
from meshtron.hlo.summary import MemoryFigures, StepAnalysis, analyze
from meshtron.hlo.text import (
    ArrayShape,
    HloComputation,
    HloInstruction,
    HloModule,
    execution_counts,
    parse_hlo_module,
    parse_shape,
)
from meshtron.megatron import (
    MESHTRON_BLOCK,
    BlockActivations,
    MegatronFigures,
    layer_activation_bytes,
    megatron_figures,
    megatron_flops,
    megatron_params,
    megatron_stage_activation_bytes,
    model_flops_per_token,
    paper_layer_activation_bytes,
    pipeline_activation_bytes,
)
from meshtron.units import format_bytes, format_count

__all__ = [
    "COLLECTIVE_KINDS",
    "MESHTRON_BLOCK",
    "ArrayShape",
    "BlockActivations",
    "Collective",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "MegatronFigures",
    "MemoryFigures",
    "StepAnalysis",
    "analyze",
    "bytes_by_axes",
    "collectives",
    "count_by",
    "execution_counts",
    "format_bytes",
    "format_count",
    "iota_device_groups",
    "layer_activation_bytes",
    "megatron_figures",
    "megatron_flops",
    "megatron_params",
    "megatron_stage_activation_bytes",
    "model_flops_per_token",
    "paper_layer_activation_bytes",
    "parse_hlo_module",
    "parse_shape",
    "pipeline_activation_bytes",
    "ring_wire_bytes",
]
