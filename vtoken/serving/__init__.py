"""vtoken inside serving engines (see `vtoken.serving.vllm`)."""
