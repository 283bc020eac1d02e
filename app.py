"""Builds the QEvict studio and launches it.

Environment: QEVICT_MODEL (default: the bundled SmolLM2-135M-Instruct), QEVICT_DEVICE, DATABASE_URL (default: a
SQLite file under data/), GRADIO_SERVER_NAME (default 127.0.0.1; 0.0.0.0 in the Docker image), GRADIO_SERVER_PORT
(default 7860), QEVICT_IMPORT_MAX_MB (default 16).
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from qevict_core import load_model  # noqa: E402
from storage import SessionStore, make_engine  # noqa: E402
from storage.schema import max_import_bytes  # noqa: E402
from ui.studio import Studio  # noqa: E402
from ui.blocks import build_demo  # noqa: E402
from ui.theme import CSS, HEAD, THEME  # noqa: E402


def create_demo(model=None, tokenizer=None, database_url: str | None = None, model_name: str | None = None):
    if model is None:
        model, tokenizer = load_model(os.environ.get("QEVICT_MODEL") or None, device=os.environ.get("QEVICT_DEVICE"))
    store = SessionStore(make_engine(database_url))
    store.mark_interrupted()  # runs cut off by a crash or restart say so instead of "running" forever
    studio = Studio(model, tokenizer, store, model_name or os.environ.get("QEVICT_MODEL") or "SmolLM2-135M-Instruct")
    # Generation and diagnostics share one model worker (concurrency_id "gpu", limit 1); replays, drawings and the
    # sessions list run beside it, several at once, so one visitor's long replay never holds another's page.
    return build_demo(studio).queue(default_concurrency_limit=8, max_size=32)


def launch(demo, **kwargs):
    return demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                       server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                       theme=THEME, css=CSS, head=HEAD, ssr_mode=False, share=False, footer_links=["api"],
                       max_file_size=max_import_bytes(),
                       # Runs are kept server side and listed per browser; Gradio's own history would copy every
                       # streamed figure into the browser's storage.
                       run_history=False, **kwargs)


if __name__ == "__main__":
    launch(create_demo())
