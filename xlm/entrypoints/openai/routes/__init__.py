"""The server's routes, one router per family; `build_app` includes every one of ROUTERS.

Adding a route family is adding a module here with an `APIRouter` and listing it below.
"""

from xlm.entrypoints.openai.routes import (
    embeddings,
    generate,
    messages,
    models,
    responses,
    score,
    sleep,
    system,
)

ROUTERS = (
    system.router,
    models.router,
    generate.router,
    embeddings.router,
    responses.router,
    messages.router,
    score.router,
    sleep.router,
)
