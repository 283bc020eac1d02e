"""The QEvict studio: Gradio Blocks built from pure handler functions and plot builders."""
