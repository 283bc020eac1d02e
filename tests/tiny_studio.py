"""The studio on the tiny random chat model, as its own process:
``python -m tests.tiny_studio PORT DATABASE_URL [SECONDS_PER_FORWARD]``.

The crash test kills this process with SIGKILL mid-run and starts it again on the same database. The optional
delay makes every forward as slow as a real model's on a CPU, so a run is still going when the test kills it.
"""

import os
import sys

if __name__ == "__main__":
    port, url = sys.argv[1], sys.argv[2]
    os.environ["GRADIO_SERVER_PORT"] = port
    import torch

    torch.set_num_threads(1)
    import app
    from qevict_core.testing import tiny_chat_model, tiny_tokenizer

    model = tiny_chat_model()
    if len(sys.argv) > 3:
        import time

        delay = float(sys.argv[3])
        model.register_forward_pre_hook(lambda *_: time.sleep(delay))
    app.launch(app.create_demo(model, tiny_tokenizer(), database_url=url, model_name="tiny"))
