"""vLLM beside specdec: it lives in an environment of its own (`specdec setup-vllm`), and specdec talks
to it through a worker process, JSON lines in and out (worker.py, run by that environment's python)."""
