"""Dashboard assets (served by the API under ``/``; no CDN, everything ships here)."""
