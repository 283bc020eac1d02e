"""How the studio looks: Gradio theme, CSS and one script, all passed to ``launch()`` (Gradio 6)."""

import gradio as gr

THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "monospace"])
CSS = """
.qe-lanes {display:flex; gap:10px; flex-wrap:wrap}
.qe-lane {flex:1; min-width:240px; border:1px solid #d1d5db; border-radius:8px; padding:8px}
.qe-verdict {font-size:12px; padding:1px 6px; border-radius:6px}
.qe-good {background:#dcfce7; color:#14532d} .qe-bad {background:#fee2e2; color:#7f1d1d}
.qe-pending {background:#f3f4f6; color:#374151; font-style:italic} .qe-cut {background:#e5e7eb; color:#1f2937}
.qe-same {background:#f3f4f6; color:#374151} .qe-differs {background:#fef3c7; color:#78350f}
.qe-note {font-size:12px; background:#fef3c7; border-radius:6px; padding:4px 6px; margin-top:4px}
.qe-stats, .qe-caption {font-size:12px; color:#4b5563}
.qe-text {white-space:pre-wrap; overflow-wrap:anywhere; margin-top:6px}
.qe-diverged {text-decoration:underline wavy #ef4444}
.qe-prompt-text {white-space:pre-wrap; font-family:ui-monospace,monospace; font-size:12px; line-height:1.6;
                 max-height:320px; overflow:auto; overflow-wrap:anywhere}
.qe-key {padding:0 4px; margin-right:2px; white-space:nowrap}
.qe-moves ul {margin:4px 0 0 18px; font-size:13px}
#status {min-height:4em}
/* A phone (390 px): wide tables scroll inside their own box instead of squeezing words to a few letters or
   clipping columns; the page itself never scrolls sideways. */
#methods table, #glossary table {display:block; overflow-x:auto; max-width:100%}
#methods td, #methods th {min-width:7em; overflow-wrap:normal; word-break:normal}
#sessions-table, #stats, #replay-stats {max-width:100%; overflow-x:auto}
@media (max-width: 600px) {
  #methods td:nth-child(2) {min-width:14em}
  .qe-lane {min-width:0; flex-basis:100%}
}
/* Presentation mode (a projector, the "present" box or &present=1): large type everywhere, and the routing of one
   lane in focus: the settings, the tables, the bytes plot and the reference accordions step aside, the tier map and
   the scores take the whole width (their figures are redrawn large by plots.LARGE). Gradio repeats each rule of
   this sheet under its container's classes, which outranks a body class: sizes here are !important. */
body.qe-present .gradio-container {--text-xxs:14px; --text-xs:16px; --text-sm:18px; --text-md:20px; --text-lg:24px;
  --text-xl:28px; --text-xxl:34px; --body-text-size:20px; --block-label-text-size:18px; --block-title-text-size:20px;
  --block-info-text-size:18px; --input-text-size:20px; --button-large-text-size:22px; --button-small-text-size:18px;
  --section-header-text-size:20px; --prose-text-size:20px; font-size:20px}
body.qe-present .qe-stats, body.qe-present .qe-caption, body.qe-present .qe-verdict, body.qe-present .qe-note,
body.qe-present .qe-prompt-text, body.qe-present .qe-moves ul {font-size:18px !important}
body.qe-present .qe-text {font-size:22px !important}
body.qe-present #intro, body.qe-present .qe-aside, body.qe-present #stats, body.qe-present #replay-stats,
body.qe-present #bytes, body.qe-present #replay-bytes {display:none !important}
body.qe-present .qe-routing {flex-wrap:wrap}
body.qe-present .qe-routing > * {min-width:100% !important}
#qe-notice {position:fixed; bottom:16px; left:50%; transform:translateX(-50%); z-index:1000; max-width:90vw;
            background:#111827; color:#fff; padding:8px 12px; border-radius:8px; font-size:14px; display:none}
"""
# Gradio's number boxes clamp a typed value to the control's range when they lose focus, silently. This reads the
# typed value first (capture phase) and says what happened when the box then shows something else.
HEAD = """<script>
document.addEventListener("blur", (event) => {
  const box = event.target;
  if (!(box instanceof HTMLInputElement) || box.type !== "number" || box.value === "") return;
  const typed = box.value;
  setTimeout(() => {
    if (box.value === typed) return;
    const label = (box.getAttribute("aria-label") || "value").replace(/^number input for /, "");
    let note = document.getElementById("qe-notice");
    if (!note) {
      note = document.createElement("div");
      note.id = "qe-notice";
      note.setAttribute("role", "status");
      document.body.appendChild(note);
    }
    const range = `${box.min || "…"}–${box.max || "…"}`;
    note.textContent = `${label}: ${typed} is outside ${range}, so it was set to ${box.value}.`;
    note.style.display = "block";
    clearTimeout(note.hideTimer);
    note.hideTimer = setTimeout(() => { note.style.display = "none"; }, 6000);
  }, 50);
}, true);
</script>"""
