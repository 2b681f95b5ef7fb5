"""What runs a group: the training-time cache (K/V, recurrent states, MoE routes), the attention function, wave
layouts, memory hooks and the phase scheduler (Phase A, the waves, Phase C)."""
