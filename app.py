"""Builds the QEvict studio and launches it: `make run`, the Docker image, a Hugging Face Space (docs/studio.md).

Environment: QEVICT_MODEL (default: the bundled SmolLM2-135M-Instruct; on a Space without it, the same model from
the Hub), QEVICT_DEVICE, DATABASE_URL (default: a SQLite file in /data when a Space has persistent storage, else
under data/), GRADIO_SERVER_NAME (default 127.0.0.1; 0.0.0.0 in the Docker image and on a Space),
GRADIO_SERVER_PORT (default 7860), QEVICT_IMPORT_MAX_MB (default 16).
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import ui.gpu  # noqa: E402,F401 - first: on ZeroGPU, `spaces` must be imported before anything touches CUDA
from qevict_core import load_model  # noqa: E402
from qevict_core.models import DEFAULT_MODEL, bundled_installed  # noqa: E402
from storage import SessionStore, make_engine  # noqa: E402
from storage.schema import max_import_bytes  # noqa: E402
from ui.studio import Studio  # noqa: E402
from ui.blocks import build_demo  # noqa: E402
from ui.theme import CSS, HEAD, THEME  # noqa: E402

HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled model's source, for a Space (no --no-deps there)


def model_setting() -> tuple[str | None, str]:
    """(what load_model gets, the name the studio shows). On a Space (SPACE_ID set) where the bundled model's
    package could not be installed, the same model from the Hub."""
    chosen = os.environ.get("QEVICT_MODEL")
    if chosen:
        return chosen, chosen
    if os.environ.get("SPACE_ID") and not bundled_installed():
        return HUB_MODEL, HUB_MODEL
    return None, DEFAULT_MODEL


def create_demo(model=None, tokenizer=None, database_url: str | None = None, model_name: str | None = None):
    if model is None:
        name, model_name = model_setting()
        on_zerogpu = ui.gpu.ZERO_GPU
        # ZeroGPU attaches a GPU inside each @spaces.GPU call; the model is placed on "cuda" at start-up, in bf16
        # (its H200 slices compute in it), without asking the driver (no CUDA before the fork).
        model, tokenizer = load_model(name, device="cuda" if on_zerogpu else os.environ.get("QEVICT_DEVICE"),
                                      dtype="bfloat16" if on_zerogpu else None)
    store = SessionStore(make_engine(database_url))
    store.migrate()  # sessions stored by an earlier version, in the current shape (idempotent)
    store.mark_interrupted()  # runs cut off by a crash or restart say so instead of "running" forever
    studio = Studio(model, tokenizer, store, model_name or DEFAULT_MODEL)
    # Generation and diagnostics share one model worker (concurrency_id "gpu", limit 1); replays, drawings and the
    # sessions list run beside it, several at once, so one visitor's long replay never holds another's page.
    return build_demo(studio).queue(default_concurrency_limit=8, max_size=32)


def launch(demo, **kwargs):
    on_space = bool(os.environ.get("SPACE_ID"))
    return demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0" if on_space else "127.0.0.1"),
                       server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                       theme=THEME, css=CSS, head=HEAD, ssr_mode=False, share=False, footer_links=["api"],
                       # a file over the import limit reaches the import, which says why in the status line (a
                       # refusal by Gradio itself is a toast that vanishes); only a far larger one stops at the door
                       max_file_size=4 * max_import_bytes(),
                       # Runs are kept server side and listed per browser; Gradio's own history would copy every
                       # streamed figure into the browser's storage.
                       run_history=False, **kwargs)


if __name__ == "__main__":
    launch(create_demo())
