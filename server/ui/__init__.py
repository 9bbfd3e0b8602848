"""The chat page served at `GET /` (static files, no build step; `--no-ui` turns it off)."""
