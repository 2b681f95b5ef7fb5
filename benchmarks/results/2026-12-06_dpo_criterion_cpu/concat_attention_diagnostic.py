import argparse, torch, dpo_criterion, json
args = argparse.Namespace(tiny=False, device="cpu", lora=True, prompt=768, response=128, lr=0.03, beta=0.1, head_dim=128, checkpointing=True, pairs=2, steps=1, seed=1)
torch.set_float32_matmul_precision("highest")
for v in ("concat-attention",):
    rows = dpo_criterion.run_case(args, v)
    for r in rows: print("DIAG", v, r.get("worst_ratio"), r.get("worst_param"), r.get("median_ratio"), r.get("error"))
