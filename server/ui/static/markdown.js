// A small, safe Markdown subset for model output: fenced code blocks, inline code, **bold**, lists and
// paragraphs. Every piece of the text is HTML-escaped before any markup is added, and the only markup
// added is this module's own fixed tags, so model output can never become HTML (no <script>, no
// attributes, no links). The result is meant for innerHTML; nothing else here builds HTML.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d{1,9}[.)]\s+(.*)$/;

/** `code` spans first (their content is taken literally), then **bold** in the rest. */
export function renderInline(text) {
  return String(text).split(/(`[^`\n]+`)/).map((part, i) => {
    if (i % 2 === 1) return `<code>${escapeHtml(part.slice(1, -1))}</code>`;
    return escapeHtml(part).replace(/\*\*(?=\S)(.+?)\*\*/g, "<strong>$1</strong>");
  }).join("");
}

/** Markdown text -> HTML string (safe for innerHTML). An unclosed fence (a reply still streaming) is code
 *  up to the end of the text. */
export function renderMarkdown(text) {
  const out = [];
  let para = [];
  let list = null;  // {tag, items}
  let code = null;  // {lang, lines}
  const flushPara = () => {
    if (para.length) out.push(`<p>${para.map(renderInline).join("<br>")}</p>`);
    para = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((t) => `<li>${renderInline(t)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  const flushCode = () => {
    const cls = code.lang ? ` class="language-${escapeHtml(code.lang)}"` : "";
    out.push(`<pre><code${cls}>${escapeHtml(code.lines.join("\n"))}</code></pre>`);
    code = null;
  };
  for (const line of String(text).split("\n")) {
    const fence = line.match(FENCE);
    if (code) {
      if (fence && !fence[1]) flushCode();
      else code.lines.push(line);
      continue;
    }
    if (fence) {
      flushPara(); flushList();
      code = { lang: fence[1], lines: [] };
      continue;
    }
    const bullet = line.match(BULLET);
    const numbered = bullet ? null : line.match(NUMBERED);
    if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      list = list || { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
    } else if (!line.trim()) {
      flushPara(); flushList();
    } else {
      flushList();
      para.push(line);
    }
  }
  flushPara(); flushList();
  if (code) flushCode();
  return out.join("");
}
