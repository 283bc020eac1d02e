"""Gradio components the studio adapts. (Gradio writes a ``.pyi`` stub beside any module that subclasses a
component; ``components.pyi`` is that stub, kept in the repository so nothing is written at run time.)

Each control of the Generate form passes what it receives to ``ui.form`` untouched. Gradio's own preprocessing would
refuse an API value off the choices with an exception (a bare error instead of the nine documented outputs), or
convert it silently (``str(["a"])`` for a textbox, ``"16"`` to a number); the form's schema does both jobs instead
and answers with the reason in ``status``."""

import gradio as gr


def declare(self, api: dict):
    """This control's schema in the API (``ui.form.api_schema``): what ``/generate`` advertises is what its
    validator accepts, not what the widget shows right now (a lane menu without its ablations, say). -> the
    control. (Not a constructor argument: Gradio reads a component's props from those.)"""
    self._declared_api = api
    return self


def api_info(self) -> dict:
    declared = getattr(self, "_declared_api", None)
    return declared if declared is not None else type(self).__base__.api_info(self)


class FormSlider(gr.Slider):
    """A slider whose value reaches ``ui.form`` unchecked."""

    is_template = True  # drawn by Gradio's own slider
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload


class FormDropdown(gr.Dropdown):
    """A dropdown whose value reaches ``ui.form`` unchecked (an unknown lane is the form's to refuse)."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload


class FormRadio(gr.Radio):
    """A radio group whose value reaches ``ui.form`` unchecked."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload


class FormTextbox(gr.Textbox):
    """A textbox whose value reaches ``ui.form`` unconverted (a list is refused there, not made a string)."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload


class FormNumber(gr.Number):
    """A number box whose value reaches ``ui.form`` unconverted."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload


class FormCheckbox(gr.Checkbox):
    """A checkbox whose value reaches ``ui.form`` unconverted ("yes" is not True)."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload
