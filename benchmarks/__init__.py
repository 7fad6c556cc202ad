"""Quality and performance benchmarks for Blendserve (CacheBlend): `python -m benchmarks.run --quick|--full`."""
