"""`python -m app` (what `make run` runs): read ServiceSettings, serve the API with uvicorn."""

from __future__ import annotations

import logging
import sys

from pydantic import ValidationError

from app.settings import ServiceSettings
from blendserve_config.env import SettingsNameError

logger = logging.getLogger("app")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = ServiceSettings()
    except ValidationError as exc:  # fail fast, naming the variable
        lines = [f"  BLENDSERVE_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in exc.errors()]
        logger.error("invalid configuration:\n%s", "\n".join(lines))
        return 2
    except SettingsNameError as exc:  # an unknown BLENDSERVE_* name, with the closest valid one
        logger.error("invalid configuration: %s", exc)
        return 2
    logging.getLogger().setLevel(settings.service.log_level.upper())

    import uvicorn

    from app.main import create_app
    from blend_engine.model.cpu_threads import single_core_default

    single_core_default()  # before any thread starts: only the engine loop computes on every core

    app = create_app(settings)
    svc = settings.service
    logger.info("serving on http://%s:%d (docs at /docs)", svc.host, svc.port)
    uvicorn.run(app, host=svc.host, port=svc.port, log_level=svc.log_level.lower(), timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
