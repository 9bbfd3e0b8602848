// The chat page: wires the controls to the conversation tree (tree.js), the server calls (actions.js)
// and the rendering (view.js). One generation at a time; everything else waits for it.

import * as actions from "./actions.js";
import * as api from "./api.js";
import * as store from "./store.js";
import * as tree from "./tree.js";
import * as view from "./view.js";

const $ = (id) => document.getElementById(id);
const state = { index: store.loadIndex(), conv: null, busy: null, editing: null, seqCells: new Map() };

function save() {
  store.saveConversation(state.index, state.conv);
}

function notice(text, kind = "info") {
  const box = $("notice");
  box.textContent = text || "";
  box.className = `notice ${kind}`;
  box.hidden = !text;
}

const handlers = {
  step(node, delta) { tree.stepSibling(state.conv, node, delta); save(); render(); },
  edit(node) { state.editing = node.id; render(); $(`edit-${node.id}`)?.focus(); },
  cancelEdit() { state.editing = null; render(); },
  saveEdit(node, text) {
    if (!text.trim()) return;
    state.editing = null;
    act((run) => actions.send(state.conv, node.parent, text.trim(), run));
  },
  reply(node) { act((run) => actions.replyTo(state.conv, node.id, run)); },
  regenerate(node) { act((run) => actions.replyTo(state.conv, node.parent, run)); },
  remove(node) { act(() => actions.deleteBranch(state.conv, node.id)); },
};

function renderTree() {
  const focused = document.activeElement?.closest?.("#tree [data-node-id]")?.dataset.nodeId;
  view.renderTree($("tree"), state.conv, (id) => { tree.select(state.conv, id); save(); render(); }, state.seqCells);
  if (focused) $("tree").querySelector(`[data-node-id="${focused}"]`)?.focus();  // keyboard users keep their place
}

function render() {
  const conv = state.conv;
  const busy = Boolean(state.busy);
  view.renderMessages($("messages"), conv, handlers, { busy, editing: state.editing });
  renderTree();
  view.renderChatList($("chat-list"), state.index, conv.id, { open: openConversation, remove: removeConversation });
  const leaf = tree.leaf(conv);
  const gone = tree.isGone(conv, leaf);
  $("send").disabled = busy || gone;
  $("stop").hidden = !busy;
  $("messages").setAttribute("aria-busy", busy ? "true" : "false");
  $("composer-hint").textContent = gone ? "This branch is gone from the server; edit an earlier message or start a new chat." : "";
  document.title = `${conv.title} · cellserve`;
}

/** Keep the newest text in view while a reply streams (the message list, or the page when narrow). */
function followTail() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
  const last = list.lastElementChild;
  if (last && list.scrollHeight <= list.clientHeight + 1) last.scrollIntoView({ block: "end" });
}

/** Run one server action with the page locked; its error (if any) shows in the notice line. */
async function act(fn) {
  if (state.busy) return;
  const controller = new AbortController();
  state.busy = { controller };
  notice("");
  const run = {
    signal: controller.signal,
    started: () => { render(); followTail(); refreshGauge(); },
    delta: (node) => { view.updateContent($("messages"), node); followTail(); },
  };
  render();
  try {
    await fn(run);
  } catch (e) {
    notice(e.message, "error");
    if (e.restoreText && !$("input").value) $("input").value = e.restoreText;
  } finally {
    state.busy = null;
    save();
    render();
    refreshGauge();
  }
}

function sendFromComposer() {
  const text = $("input").value.trim();
  if (!text || state.busy) return;
  $("input").value = "";
  const parent = tree.leaf(state.conv);
  act((run) => actions.send(state.conv, parent.id, text, run));
}

async function refreshGauge() {
  try {
    const cache = await api.json("GET", "/v1/cache");
    const cells = new Map(cache.sequences.map((s) => [s.id, s.cells]));
    const changed = JSON.stringify([...cells]) !== JSON.stringify([...state.seqCells]);
    state.seqCells = cells;
    view.renderGauge($("gauge"), cache);
    if (changed && !state.busy) renderTree();  // only when the numbers moved: a re-render drops the focus
  } catch (e) {
    $("gauge").querySelector(".gauge-text").textContent = `cells: ${e.message}`;
  }
}

/** Which of the conversation's sequences the server still has (after a restart: none). */
async function syncConversation() {
  try {
    const list = await api.json("GET", "/v1/sequences");
    const gone = tree.syncWithServer(state.conv, list.data);
    if (gone) {
      notice(`${gone} branch${gone > 1 ? "es" : ""} of this conversation ${gone > 1 ? "are" : "is"} gone from the ` +
             "server (restart or --seq-ttl expiry): shown, but it cannot be continued.", "warn");
    }
    save();
    render();
  } catch (e) {
    notice(e.message, "error");
  }
}

function isEmpty(conv) {
  return !conv.nodes.root.children.length;
}

function openConversation(id) {
  if (state.busy) return;
  if (!id && state.conv && isEmpty(state.conv)) {  // "New chat" on an empty one: it is the new chat
    $("input").focus();
    return;
  }
  const conv = (id && store.loadConversation(id)) || tree.newConversation(state.conv?.settings);
  state.conv = conv;
  state.index.current = conv.id;
  state.editing = null;
  save();
  fillSettings();
  notice("");
  render();
  if (Object.keys(conv.seqs).length) syncConversation();
}

async function removeConversation(id) {
  if (state.busy) return;
  const conv = id === state.conv.id ? state.conv : store.loadConversation(id);
  if (conv) await actions.deleteConversation(conv);
  store.removeConversation(state.index, id);
  if (id === state.conv.id) openConversation(state.index.list[0]?.id);
  else render();
  refreshGauge();
}

const SETTINGS = ["temperature", "top_p", "max_tokens", "system", "schema"];

function fillSettings() {
  for (const name of SETTINGS) $(`set-${name}`).value = state.conv.settings[name] ?? "";
  checkSchema();
}

function checkSchema() {
  const text = $("set-schema").value.trim();
  let error = "";
  if (text) {
    try { JSON.parse(text); } catch (e) { error = `not valid JSON: ${e.message}`; }
  }
  $("schema-error").textContent = error;
}

function askKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason || "This server needs an API key.";
  $("key-input").value = "";
  return new Promise((resolve) => {
    const done = (key) => {
      $("key-form").onsubmit = null;
      $("key-cancel").onclick = null;
      dialog.close();
      resolve(key);
    };
    $("key-form").onsubmit = (e) => { e.preventDefault(); done($("key-input").value.trim()); };
    $("key-cancel").onclick = () => done(null);
    dialog.showModal();
    $("key-input").focus();
  });
}

function wire() {
  api.onKeyNeeded(askKey);
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); sendFromComposer(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendFromComposer(); }
  });
  $("stop").addEventListener("click", () => state.busy?.controller.abort());
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.busy) state.busy.controller.abort(); });
  $("new-chat").addEventListener("click", () => openConversation(null));
  $("key-button").addEventListener("click", async () => {
    const key = await askKey("Set the API key for this tab (kept in sessionStorage); empty forgets it.");
    if (key !== null) api.setKey(key || null);
    refreshGauge();
  });
  $("settings").addEventListener("input", (e) => {
    const name = e.target.name;
    if (!SETTINGS.includes(name)) return;
    state.conv.settings[name] = e.target.value;
    if (name === "schema") checkSchema();
    save();
  });
  $("settings").addEventListener("submit", (e) => e.preventDefault());
}

async function start() {
  wire();
  openConversation(state.index.current);
  try {
    const models = await api.json("GET", "/v1/models");
    $("model").textContent = models.data[0]?.id ?? "";
  } catch (e) {
    notice(e.message, "error");
  }
  refreshGauge();
  setInterval(() => { if (!document.hidden) refreshGauge(); }, 2000);
}

start();
