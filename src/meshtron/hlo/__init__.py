"""Instruments on compiled programs, read from their optimized HLO text: :mod:`.text` parses it,
:mod:`.collectives` lists the collectives with their mesh axes, sizes and counts, :mod:`.summary`
sums a step up (collectives, FLOPs, memory), :mod:`.order` proves no device can start its
collectives in another order (the pipeline runtime's deadlock rule). No JAX is needed to read.
"""
