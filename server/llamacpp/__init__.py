"""llama.cpp's native HTTP API (llama-server's own routes) on cellserve's engine."""
