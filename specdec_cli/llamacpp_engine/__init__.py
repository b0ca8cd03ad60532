"""llama.cpp (llama-cpp-python) beside specdec: its environment (`specdec setup-llamacpp`), and a
worker process running the target's GGUF file as it ships (`benchmark --peer llamacpp`)."""
