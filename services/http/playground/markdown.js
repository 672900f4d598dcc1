// Markdown for model output, built from DOM nodes and text nodes only: no string ever becomes HTML, so a `<script>`
// in an answer is shown as the characters it is. Supported: code fences (an unclosed one while the answer streams),
// headings, bullet and numbered lists, paragraphs, `code`, **bold** and *emphasis*.

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\n]+\*|_[^_\n]+_)/g;

function inline(parent, text) {
  let at = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > at) parent.append(document.createTextNode(text.slice(at, match.index)));
    const [token] = match;
    if (match[1]) parent.append(el("code", "", token.slice(1, -1)));
    else if (match[2]) parent.append(el("strong", "", token.slice(2, -2)));
    else parent.append(el("em", "", token.slice(1, -1)));
    at = match.index + token.length;
  }
  if (at < text.length) parent.append(document.createTextNode(text.slice(at)));
}

function codeBlock(language, code) {
  const figure = el("div", "code-block");
  const bar = el("div", "code-bar");
  bar.append(el("span", "", language || "code"));
  const copy = el("button", "quiet", "Copy code");
  copy.type = "button";
  copy.addEventListener("click", () => navigator.clipboard?.writeText(code));
  bar.append(copy);
  const pre = el("pre");
  pre.append(el("code", "", code));
  figure.append(bar, pre);
  return figure;
}

function paragraphs(parent, text) {
  const lines = text.split("\n");
  let list = null;
  let para = null;
  const close = () => {
    list = null;
    para = null;
  };
  for (const line of lines) {
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
    const numbered = /^\s*\d+[.)]\s+(.*)$/.exec(line);
    if (!line.trim()) {
      close();
    } else if (heading) {
      close();
      const h = el(`h${Math.min(6, heading[1].length + 2)}`);
      inline(h, heading[2]);
      parent.append(h);
    } else if (bullet || numbered) {
      const tag = bullet ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = el(tag);
        parent.append(list);
      }
      para = null;
      const item = el("li");
      inline(item, (bullet || numbered)[1]);
      list.append(item);
    } else {
      list = null;
      if (!para) {
        para = el("p");
        parent.append(para);
      } else {
        para.append(el("br"));
      }
      inline(para, line);
    }
  }
}

/** Replaces `container`'s children with `text` rendered as markdown. */
export function render(container, text) {
  const nodes = document.createDocumentFragment();
  const fence = /^```([\w+-]*)[^\n]*\n([\s\S]*?)(?:^```[ \t]*$|(?![\s\S]))/gm;
  let at = 0;
  for (const match of text.matchAll(fence)) {
    if (match.index > at) paragraphs(nodes, text.slice(at, match.index));
    nodes.append(codeBlock(match[1], match[2].replace(/\n$/, "")));
    at = match.index + match[0].length;
  }
  if (at < text.length) paragraphs(nodes, text.slice(at));
  container.replaceChildren(nodes);
}
