nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python scripts/agent_ab.py --builds A --serve "--model qwen3-30b-geometry --dummy-weights --routing synthetic --gpu-memory-limit 32 --moe-cache-auto --kv-reserve-tokens 140000 --expert-dtype fp8 --kv-cache-dtype fp8" --turns 60 --tool-tokens 2048 --json $OUT/ab_fp8.json 2>&1 | grep -v "^\[A round" | tail -22
pkill -f frontend; sleep 1; python scripts/expert_store.py remove --all
