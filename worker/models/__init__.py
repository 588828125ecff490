"""The model families Sluice runs. Both are pre-norm GQA decoders with RoPE and a sparse MoE MLP;
they differ in checkpoint names, q/k norm and routing normalisation, all captured by the config
and ``checkpoint_names``."""
