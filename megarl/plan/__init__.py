"""The layout planner: memory and step-time models for RL roles, and a search over layouts.

``memory`` counts bytes per GPU by component from the architecture and layout (the
same tensors megatron-core allocates); ``steptime`` estimates one RL step from FLOPs,
memory bandwidth and interconnect figures (``hardware``); ``search`` proposes layouts
and placements that fit, or says by how much nothing does. ``megarl bench memory``
checks the memory model against megatron-core models built here.
"""
