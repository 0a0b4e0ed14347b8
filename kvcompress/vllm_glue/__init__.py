"""vLLM 0.32 glue: plugin, scheduler, model runner, attention backend."""
