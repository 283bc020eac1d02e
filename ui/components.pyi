"""Gradio components the studio adapts. (Gradio writes a ``.pyi`` stub beside any module that subclasses a
component; ``components.pyi`` is that stub, kept in the repository so nothing is written at run time.)"""

import gradio as gr

from gradio.events import Dependency

class FormSlider(gr.Slider):
    """A slider whose value reaches ``ui.form`` unchecked."""

    is_template = True  # drawn by Gradio's own slider
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component
class FormDropdown(gr.Dropdown):
    """A dropdown whose value reaches ``ui.form`` unchecked (an unknown lane is the form's to refuse)."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component

    
class FormRadio(gr.Radio):
    """A radio group whose value reaches ``ui.form`` unchecked."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component

    
class FormTextbox(gr.Textbox):
    """A textbox whose value reaches ``ui.form`` unconverted (a list is refused there, not made a string)."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component

    
class FormNumber(gr.Number):
    """A number box whose value reaches ``ui.form`` unconverted."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component

    
class FormCheckbox(gr.Checkbox):
    """A checkbox whose value reaches ``ui.form`` unconverted ("yes" is not True)."""

    is_template = True
    declare, api_info = declare, api_info

    def preprocess(self, payload):
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component

    