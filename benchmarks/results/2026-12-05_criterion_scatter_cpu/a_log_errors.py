# Per-head scalars of the small qwen3_5 pattern: relative errors of the bf16 baseline, bf16 PrefixFlow and float32
# PrefixFlow against the float32 full-sequence reference. Run from the repository root: python <this file> SEED
import sys, torch
sys.path.insert(0, "benchmarks"); torch.set_num_threads(1)
import hybrid_group as hg, hf_prefixflow
from hf_prefixflow import _compat
seed = int(sys.argv[1])
def grads(m): return {n: p.grad.detach().double().clone() for n, p in m.named_parameters() if p.grad is not None}
ref_m = hg.build("qwen3_5", torch.float32, "cpu", small=True)
p, s, w = hg.data(ref_m.config.vocab_size, 512, 128, 4, "cpu", seed)
with _compat.reference_kernels(type(ref_m)): hg.full_sequences(ref_m, p, s, w, autocast=False)
R = grads(ref_m)
b_m = hg.build("qwen3_5", torch.bfloat16, "cpu", small=True); hg.full_sequences(b_m, p, s, w, autocast=False); B = grads(b_m)
f_m = hf_prefixflow.apply_prefixflow(hg.build("qwen3_5", torch.bfloat16, "cpu", small=True)); hg.prefixflow(f_m, p, s, w, 2); F = grads(f_m)
# the same PrefixFlow path in fp32: how exact is it at fp32?
f32 = hf_prefixflow.apply_prefixflow(hg.build("qwen3_5", torch.float32, "cpu", small=True))
with _compat.reference_kernels(type(f32)): hg.prefixflow(f32, p, s, w, 2)
F32 = grads(f32)
for n in R:
    if "A_log" in n or "dt_bias" in n:
        r = R[n]; e = lambda g: ((g - r).norm() / r.norm()).item()
        print(f"{n:40s} |ref| {r.norm():.3e} max|ref_i| {r.abs().max():.3e} err base {e(B[n]):.2e} PF {e(F[n]):.2e} PF-fp32 {e(F32[n]):.2e}")
