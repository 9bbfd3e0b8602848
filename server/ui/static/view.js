// DOM rendering: the active path's messages (with "2 / 3" branch arrows), the branch tree, the cell-pool
// gauge and the conversation list. Text goes in through textContent; model text only through
// renderMarkdown, which escapes it first.

import { renderMarkdown } from "./markdown.js";
import * as tree from "./tree.js";

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value);
  }
  node.append(...children.filter(Boolean));
  return node;
}

function roleName(node) {
  return node.role === "user" ? "You" : "Model";
}

export function setContent(target, node) {
  if (node.role === "assistant") target.innerHTML = renderMarkdown(node.text);
  else target.textContent = node.text;
}

/** Refresh one message's text while it streams (no full re-render per token). */
export function updateContent(container, node) {
  const target = container.querySelector(`[data-node-id="${node.id}"] .content`);
  if (target) setContent(target, node);
}

function branchNav(conv, node, on) {
  const { index, count } = tree.siblingPosition(conv, node);
  if (count < 2) return null;
  return el("nav", { class: "branch-nav", "aria-label": "Branches of this message" },
    el("button", { type: "button", class: "prev", "aria-label": "Previous branch", disabled: index === 0,
                   onclick: () => on.step(node, -1) }, "‹"),
    el("span", { class: "branch-pos", text: `${index + 1} / ${count}` }),
    el("button", { type: "button", class: "next", "aria-label": "Next branch", disabled: index === count - 1,
                   onclick: () => on.step(node, 1) }, "›"));
}

function fmt(n, digits = 0) {
  return n === null || n === undefined ? "–" : Number(n).toFixed(digits);
}

function statsLine(node) {
  const s = node.stats || {};
  if (node.status === "streaming") return el("div", { class: "stats", text: "generating…" });
  const items = [
    ["prompt", `prompt ${fmt(s.prompt)} tok`],
    ["reused", `history ${fmt(s.reused)} tok reused (no prefill)`],
    ["cached", `cached ${fmt(s.cached)}`],
    ["ttft", `TTFT ${fmt(s.ttftMs)} ms`],
    ["tps", `${fmt(s.tokensPerS, 1)} tok/s`],
    ["completion", `${fmt(s.completion)} tok${node.status === "stopped" ? " (stopped)" : ""}`],
  ];
  return el("div", { class: "stats" }, ...items.map(([key, text]) =>
    el("span", { class: "stat", "data-stat": key, "data-value": s[{ ttft: "ttftMs", tps: "tokensPerS" }[key] || key] ?? "", text })));
}

function actionsFor(conv, node, on, busy) {
  const gone = tree.isGone(conv, node);
  const buttons = [];
  if (node.role === "user") {
    buttons.push(el("button", { type: "button", class: "edit", disabled: busy, onclick: () => on.edit(node) }, "Edit"));
    if (!node.children.length) {
      buttons.push(el("button", { type: "button", class: "reply", disabled: busy || gone,
                                  onclick: () => on.reply(node) }, "Reply"));
    }
  } else {
    buttons.push(el("button", { type: "button", class: "regenerate", disabled: busy || tree.isGone(conv, conv.nodes[node.parent]),
                                onclick: () => on.regenerate(node) }, "Regenerate"));
  }
  buttons.push(el("button", { type: "button", class: "delete", disabled: busy, onclick: () => on.remove(node),
                              "aria-label": `Delete this branch (this message and all after it)` }, "Delete branch"));
  return el("div", { class: "actions" }, ...buttons);
}

function editor(node, on) {
  const area = el("textarea", { id: `edit-${node.id}`, class: "edit-input", rows: 3 });
  area.value = node.text;
  const save = () => on.saveEdit(node, area.value);
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); save(); }
    if (e.key === "Escape") on.cancelEdit();
  });
  return el("div", { class: "editor" },
    el("label", { for: area.id, text: "Edit message (sent as a new branch)" }), area,
    el("div", { class: "actions" },
      el("button", { type: "button", class: "save-edit", onclick: save }, "Send as new branch"),
      el("button", { type: "button", class: "cancel-edit", onclick: () => on.cancelEdit() }, "Cancel")));
}

/** The active path. `ui.editing`: the node being edited; `ui.busy`: a generation runs. */
export function renderMessages(container, conv, on, ui) {
  container.replaceChildren();
  for (const node of tree.activePath(conv)) {
    const gone = tree.isGone(conv, node);
    const content = el("div", { class: "content" });
    setContent(content, node);
    const editing = ui.editing === node.id;
    const article = el("article", { class: `msg ${node.role}`, "data-node-id": node.id, "data-status": node.status || "",
                                    "aria-label": `${roleName(node)} said` },
      el("header", { class: "msg-head" },
        el("span", { class: "role", text: roleName(node) }),
        branchNav(conv, node, on),
        gone ? el("span", { class: "badge gone", text: "gone from the server" }) : null,
        node.status === "stopped" ? el("span", { class: "badge", text: "stopped" }) : null),
      node.system ? el("div", { class: "system", text: `system: ${node.system}` }) : null,
      editing ? editor(node, on) : content,
      node.error ? el("div", { class: "error", role: "alert", text: node.error }) : null,
      node.role === "assistant" ? statsLine(node) : null,
      editing ? null : actionsFor(conv, node, on, ui.busy));
    container.append(article);
  }
}

function treeLabel(node) {
  const text = node.text.replace(/\s+/g, " ").trim();
  return `${roleName(node)}: ${text.length > 28 ? text.slice(0, 27) + "…" : text || "…"}`;
}

/** The whole tree; `seqCells`: sequence id -> its `cells` from /v1/cache, shown on each branch's tip. */
export function renderTree(container, conv, onSelect, seqCells) {
  const onPath = new Set(tree.activePath(conv).map((n) => n.id));
  const leafId = tree.leaf(conv).id;
  const build = (node) => {
    const isRoot = node.role === "root";
    const li = el("li", { class: node.children.length > 1 ? "fork" : "" });
    const cells = !isRoot && tree.isTip(conv, node) ? seqCells.get(node.seq) : null;
    li.append(el("button", {
      type: "button", "data-node-id": node.id, "aria-current": node.id === leafId ? "true" : null,
      class: `tree-node ${node.role}${onPath.has(node.id) ? " on-path" : ""}${tree.isGone(conv, node) ? " gone" : ""}`,
      onclick: () => onSelect(node.id),
    }, isRoot ? "Start" : treeLabel(node),
    cells ? el("span", { class: "cells", text: ` · ${cells.owned} cells, ${cells.shared} shared` }) : null));
    if (node.children.length) li.append(el("ul", {}, ...node.children.map((id) => build(conv.nodes[id]))));
    return li;
  };
  container.replaceChildren(el("ul", { class: "tree-root" }, build(conv.nodes.root)));
}

/** The cell pool from /v1/cache: used (held by sequences and requests), cached (evictable), free. */
export function renderGauge(container, cache) {
  const { total, used, cached, free } = cache.cells;
  const pct = (n) => `${total ? (100 * n) / total : 0}%`;
  container.querySelector(".used").style.width = pct(used);
  container.querySelector(".cached").style.width = pct(cached);
  container.dataset.used = used;
  container.dataset.cached = cached;
  container.dataset.free = free;
  container.dataset.total = total;
  const shared = cache.sequences.reduce((sum, s) => sum + s.cells.shared, 0);
  container.querySelector(".gauge-text").textContent =
    `cells: ${used} used · ${cached} cached · ${free - cached} free of ${total} · ${cache.sequences.length} seqs, ` +
    `${shared} shared claims`;
}

export function renderChatList(list, index, currentId, on) {
  list.replaceChildren(...index.list.map((entry) => el("li", { class: entry.id === currentId ? "current" : "" },
    el("button", { type: "button", class: "open-chat", "aria-current": entry.id === currentId ? "true" : null,
                   onclick: () => on.open(entry.id) }, entry.title),
    el("button", { type: "button", class: "delete-chat", "aria-label": `Delete conversation ${entry.title}`,
                   onclick: () => on.remove(entry.id) }, "×"))));
}
