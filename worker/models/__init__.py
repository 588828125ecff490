"""The model families Sluice runs, each a module that registers itself in ``registry`` under its
checkpoint architectures (``classic``: Mixtral and Qwen3-MoE; ``qwen3_hybrid``: Qwen3.5-MoE and
Qwen3-Next), and the parts they are built from: one decoder (``moe_transformer``) whose layers mix
tokens by GQA over paged KV or by Gated DeltaNet over a recurrent state (``gated_deltanet``), then
run the MoE; norms, projections and rotary kernels; where each family's weights live
(``checkpoint_names``, ``hybrid_weights``) and their layout (``weights``)."""
