"""Weight-only INT8/INT4 quantization, quantized KV caches, and the tools to measure what they cost:
formats.py (what a packed weight is), linear.py (the layers), loading.py (quantization at load, GGUF blocks
as they are), kv_cache.py (fp8/int8 caches), quantize.py + checkpoint.py (`tokenmill quantize`),
eval.py + replay.py + report.py (`tokenmill quant-eval`), bench.py (GPU kernel timings). See docs/QUANTIZATION.md."""
