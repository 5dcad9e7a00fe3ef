"""Building blocks of the decoder: RMSNorm, rotary embedding, SiLU-and-multiply (and the sampler)."""
