"""The served model's card (``GET /v1/models``, ``GET /v1/models/{id}``) and ``GET /health``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from lily.server.core import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict:
    state = state_of(request)
    batch = state.worker.info()
    running, queued = batch["running"], batch["queued"]
    cache = getattr(state.engine, "prompt_cache", None)
    return {"status": "ok", "model": state.model_name, "busy": running > 0, "running": running,
            "queued": queued, "pending": running + queued, "batch": batch,
            "prompt_cache": cache.info() if cache is not None else None}


def model_card(state) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "lily", "max_model_len": state.engine.max_context}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(state_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    state = state_of(request)
    state.check_model(model_id, lookup=True)
    return model_card(state)
