"""Methods vLLM adds to its worker when ``options()`` names this class (``worker_extension_cls``): what
``qevict_vllm.report(llm)`` asks the engine's process for, by name (no code crosses, so no insecure
serialization is needed), in vLLM's default multiprocess mode too."""

from __future__ import annotations


class QEvictWorkerExtension:
    def qevict_report(self) -> dict:
        from . import report_here

        return report_here()
