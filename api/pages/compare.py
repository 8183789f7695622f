"""Dashboard page: compare (placeholder, being built)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
