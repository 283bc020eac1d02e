"""Gradio components the studio adapts. (Gradio writes a ``.pyi`` stub beside any module that subclasses a
component; ``components.pyi`` is that stub, kept in the repository so nothing is written at run time.)"""

import gradio as gr


class FormSlider(gr.Slider):
    """A slider whose value reaches ``ui.form`` unchecked: Gradio would refuse an out-of-range API value with an
    exception before the form could answer with a well-formed result that says what is allowed."""

    is_template = True  # drawn by Gradio's own slider

    def preprocess(self, payload):
        return payload
