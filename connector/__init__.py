"""vLLM KV connector over the Mooncake store, built on `lifecycle`."""
