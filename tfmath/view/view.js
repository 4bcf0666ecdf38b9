(function(){
'use strict';
// Everything below reads and writes inside this view's root element only.
const root=document.getElementById(ROOT_ID);
const data=JSON.parse(root.querySelector('script.tfv-data').textContent);
const [NL,NH,NQ,NK]=data.shape;
const ROW=20, LINES_WIDTH=240, SVG_NS='http://www.w3.org/2000/svg';
const COLOURS=['#1f77b4','#ff7f0e','#2ca02c','#d62728','#9467bd','#8c564b','#e377c2',
  '#7f7f7f','#bcbd22','#17becf','#393b79','#637939'];
const panel=root.querySelector('.tfv-panel');
const layerSel=root.querySelector('select.tfv-layer');
const headSel=root.querySelector('select.tfv-head');
const tabs=Array.from(root.querySelectorAll('.tfv-tab'));
const state={view:data.view,layer:data.selected[0],head:data.selected[1],query:data.selected[2],
  key:0,heads:new Set(Array.from({length:NH},(_,h)=>h))};
let W=null, mask=null, Q=null, K=null;

function colour(h){return h<COLOURS.length?COLOURS[h]:'hsl('+Math.round(h*137.5%360)+',65%,40%)';}
function el(tag,cls,text){
  const e=document.createElement(tag);
  if(cls){e.className=cls;}
  if(text!==undefined){e.textContent=text;}
  return e;
}
function blob(name){
  const s=root.querySelector('script.tfv-blob[data-name="'+name+'"]');
  return s?s.textContent:null;
}
function bytes(text){
  const s=atob(text), a=new Uint8Array(s.length);
  for(let i=0;i<s.length;i++){a[i]=s.charCodeAt(i);}
  return a;
}
async function inflate(a){
  const stream=new Blob([a]).stream().pipeThrough(new DecompressionStream('deflate'));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
function weight(l,h,i,k){return W[((l*NH+h)*NQ+i)*NK+k]/data.levels;}
function visible(i,k){
  if(!mask){return true;}
  const n=i*NK+k;
  return ((mask[n>>3]>>(7-(n&7)))&1)===1;
}
function fmt(x){return Math.abs(x)>=1e4||(x!==0&&Math.abs(x)<1e-3)?x.toExponential(3):x.toFixed(4);}

// Query token buttons: click or focus selects, the arrow keys move.
function tokenButtons(container,onSelect){
  const buttons=data.queries.map((t,i)=>{
    const b=el('button',null,t);
    b.type='button';
    b.setAttribute('data-token-index',i);
    b.setAttribute('aria-pressed',i===state.query?'true':'false');
    container.append(b);
    return b;
  });
  function select(i){
    state.query=i;
    buttons.forEach((b,j)=>b.setAttribute('aria-pressed',j===i?'true':'false'));
    onSelect(i);
  }
  buttons.forEach((b,i)=>{
    b.addEventListener('click',()=>select(i));
    b.addEventListener('focus',()=>select(i));
    b.addEventListener('keydown',e=>{
      let j=null;
      if(e.key==='ArrowRight'||e.key==='ArrowDown'){j=Math.min(i+1,buttons.length-1);}
      if(e.key==='ArrowLeft'||e.key==='ArrowUp'){j=Math.max(i-1,0);}
      if(j!==null){e.preventDefault();buttons[j].focus();}
    });
  });
  return buttons;
}

function headView(){
  const toggles=el('div','tfv-toggles');
  for(let h=0;h<NH;h++){
    const label=el('label'), box=el('input','tfv-toggle'), swatch=el('span','tfv-swatch');
    box.type='checkbox';box.checked=state.heads.has(h);box.setAttribute('data-head',h);
    swatch.style.background=colour(h);
    box.addEventListener('change',()=>{
      if(box.checked){state.heads.add(h);}else{state.heads.delete(h);}
      draw(state.query);
    });
    label.append(box,swatch,data.heads[h]);
    toggles.append(label);
  }
  const columns=el('div','tfv-hv'), left=el('div','tfv-col tfv-left'), right=el('div','tfv-col tfv-right');
  const svg=document.createElementNS(SVG_NS,'svg');
  svg.setAttribute('class','tfv-lines');
  svg.setAttribute('width',LINES_WIDTH);
  svg.setAttribute('height',Math.max(NQ,NK)*ROW);
  columns.append(left,svg,right);
  panel.append(toggles,columns);
  const keys=data.keys.map((t,k)=>{
    const s=el('span',null,t);
    s.setAttribute('data-key-token-index',k);
    right.append(s);
    return s;
  });
  // The lines of query i to every key, or (toKey) of every query to key i.
  function draw(i,toKey){
    svg.textContent='';
    const lines=document.createDocumentFragment();
    const heads=Array.from(state.heads).sort((a,b)=>a-b);
    for(const h of heads){
      for(let j=0;j<(toKey?NQ:NK);j++){
        const q=toKey?j:i, k=toKey?i:j;
        if(!visible(q,k)){continue;}
        const w=weight(state.layer,h,q,k), line=document.createElementNS(SVG_NS,'line');
        line.setAttribute('x1',0);line.setAttribute('y1',(q+0.5)*ROW);
        line.setAttribute('x2',LINES_WIDTH);line.setAttribute('y2',(k+0.5)*ROW);
        line.setAttribute('stroke',colour(h));line.setAttribute('stroke-width',2);
        line.setAttribute('stroke-opacity',w);
        line.setAttribute('data-head',h);line.setAttribute('data-query-index',q);
        line.setAttribute('data-key-index',k);line.setAttribute('data-weight',w);
        lines.append(line);
      }
    }
    svg.append(lines);
    keys.forEach((s,k)=>{s.className=toKey||visible(i,k)?'':'tfv-masked';});
  }
  const buttons=tokenButtons(left,draw);
  buttons.forEach((b,i)=>{
    b.addEventListener('mouseenter',()=>draw(i));
    b.addEventListener('mouseleave',()=>draw(state.query));
  });
  keys.forEach((s,k)=>{
    s.addEventListener('mouseenter',()=>draw(k,true));
    s.addEventListener('mouseleave',()=>draw(state.query));
  });
  draw(state.query);
}

// A weight as a pixel: white (0) to the view's blue (1); hidden keys in wheat.
function paint(canvas,l,h){
  const context=canvas.getContext('2d'), image=context.createImageData(NK,NQ), px=image.data;
  for(let i=0;i<NQ;i++){
    for(let k=0;k<NK;k++){
      const o=(i*NK+k)*4;
      if(visible(i,k)){
        const w=weight(l,h,i,k);
        px[o]=255-Math.round(224*w);px[o+1]=255-Math.round(160*w);px[o+2]=255-Math.round(64*w);
      }else{px[o]=245;px[o+1]=222;px[o+2]=179;}
      px[o+3]=255;
    }
  }
  context.putImageData(image,0,0);
}

function modelView(){
  const queries=el('p','tfv-tokens tfv-queries','Query (marked in red): ');
  const grid=el('table','tfv-grid'), header=el('tr');
  header.append(el('th'));
  data.heads.forEach(name=>header.append(el('th',null,name)));
  grid.append(header);
  const marks=[];
  for(let l=0;l<NL;l++){
    const row=el('tr');
    row.append(el('th',null,data.layers[l]));
    for(let h=0;h<NH;h++){
      const cell=el('button','tfv-cell'), canvas=el('canvas'), mark=el('div','tfv-rowmark');
      cell.type='button';
      cell.setAttribute('data-layer',l);cell.setAttribute('data-head',h);
      cell.setAttribute('aria-label','open '+data.layers[l]+', '+data.heads[h]+' in the head view');
      canvas.width=NK;canvas.height=NQ;
      // Blocky when enlarged; smoothed when shrunk, so that no row or column is dropped.
      canvas.style.imageRendering=NK<=96&&NQ<=96?'pixelated':'auto';
      paint(canvas,l,h);
      cell.append(canvas,mark);
      marks.push(mark);
      cell.addEventListener('click',()=>{
        state.layer=l;state.head=h;state.heads=new Set([h]);
        layerSel.value=String(l);headSel.value=String(h);
        state.view='head';render();
      });
      const td=el('td');td.append(cell);row.append(td);
    }
    grid.append(row);
  }
  function place(i){
    marks.forEach(m=>{m.style.top=(100*i/NQ)+'%';m.style.height='max(2px,'+(100/NQ)+'%)';});
  }
  tokenButtons(queries,place);
  const scroll=el('div','tfv-scroll');
  scroll.append(grid);
  panel.append(queries,scroll);
  place(state.query);
}

function rowsView(){
  const queries=el('p','tfv-tokens tfv-queries','Query: ');
  const keyLine=el('p','tfv-keys','Keys: ');
  const keys=data.keys.map((t,k)=>{
    const s=el('span',null,t);
    s.setAttribute('data-key-token-index',k);
    keyLine.append(s,' ');
    return s;
  });
  const bars=el('div','tfv-bars');
  function show(i){
    bars.textContent='';
    for(let k=0;k<NK;k++){
      const w=weight(state.layer,state.head,i,k), masked=!visible(i,k);
      const line=el('div','tfv-bar'+(masked?' tfv-masked':''));
      line.setAttribute('data-key-index',k);
      if(masked){line.setAttribute('data-masked','true');}
      else{line.setAttribute('data-weight',w);}
      const bar=el('div','b');
      bar.style.width=(masked?0:Math.round(300*w))+'px';
      line.append(el('span','k',data.keys[k]),bar,el('span',null,masked?'masked':w.toFixed(3)));
      bars.append(line);
      keys[k].className=masked?'tfv-masked':'';
      keys[k].style.background=masked?'':'rgba(31,95,191,'+w.toFixed(3)+')';
      keys[k].style.color=!masked&&w>0.5?'#fff':'';
    }
  }
  tokenButtons(queries,show);
  panel.append(queries,keyLine,bars);
  show(state.query);
}

// The computation behind one head's weights: q.k, times the scale, softmax over the keys.
function neuronView(){
  const d=data.neuron.d, scale=data.neuron.scale, l=state.layer, h=state.head;
  const vector=(array,count,row)=>array.subarray(((l*NH+h)*count+row)*d,((l*NH+h)*count+row+1)*d);
  const queries=el('p','tfv-tokens tfv-queries','Query: ');
  const body=el('div','tfv-neuron'), keyTable=el('table','tfv-steps'), vectorTable=el('table','tfv-steps');
  body.append(keyTable,vectorTable);
  function cell(tag,step,value,text){
    const c=el(tag,null,text===undefined?fmt(value):text);
    if(step){c.setAttribute('data-step',step);c.setAttribute('data-value',value);}
    return c;
  }
  function show(i){
    const q=vector(Q,NQ,i), scores=[], scaled=[];
    let top=-Infinity;
    for(let k=0;k<NK;k++){
      const key=vector(K,NK,k);
      let s=0;
      for(let j=0;j<d;j++){s+=q[j]*key[j];}
      scores.push(s);scaled.push(s*scale);
      if(visible(i,k)&&s*scale>top){top=s*scale;}
    }
    const exps=scaled.map((x,k)=>visible(i,k)?Math.exp(x-top):0);
    const total=exps.reduce((a,b)=>a+b,0);
    keyTable.textContent='';
    const head=el('tr');
    ['key','q\u00b7k','\u00d7 '+fmt(scale),'softmax'].forEach(t=>head.append(el('th',null,t)));
    keyTable.append(head);
    for(let k=0;k<NK;k++){
      const row=el('tr');
      row.setAttribute('data-neuron-key',k);
      row.setAttribute('aria-selected',k===state.key?'true':'false');
      const pick=el('button',null,data.keys[k]);pick.type='button';
      pick.addEventListener('click',()=>{state.key=k;show(i);});
      const name=el('td');name.append(pick);
      const masked=!visible(i,k);
      row.append(name,cell('td','score',scores[k]),cell('td','scaled',scaled[k]),
        cell('td','softmax',exps[k]/total,masked?'masked':undefined));
      keyTable.append(row);
    }
    const key=vector(K,NK,state.key);
    vectorTable.textContent='';
    const caption=el('caption',null,'"'+data.queries[i]+'" \u00b7 "'+data.keys[state.key]+'", '+
      data.layers[l]+', '+data.heads[h]);
    const top2=el('tr');
    ['j','q','k','q \u00d7 k'].forEach(t=>top2.append(el('th',null,t)));
    vectorTable.append(caption,top2);
    let largest=0;
    for(let j=0;j<d;j++){largest=Math.max(largest,Math.abs(q[j]*key[j]));}
    for(let j=0;j<d;j++){
      const row=el('tr'), p=q[j]*key[j], product=cell('td','product',p);
      row.setAttribute('data-dim',j);
      const shade=largest>0?Math.abs(p)/largest:0;
      product.style.background=(p>=0?'rgba(31,95,191,':'rgba(255,127,14,')+shade.toFixed(3)+')';
      product.style.color=shade>0.5?'#fff':'';
      row.append(el('td',null,String(j)),cell('td','q',q[j]),cell('td','k',key[j]),product);
      vectorTable.append(row);
    }
    const sum=el('tr');
    sum.append(el('th',null,'sum'),el('td'),el('td'),cell('td','sum',scores[state.key]));
    vectorTable.append(sum);
  }
  tokenButtons(queries,show);
  panel.append(queries,body);
  show(state.query);
}

const VIEWS={head:headView,model:modelView,rows:rowsView,neuron:neuronView};
function render(){
  panel.textContent='';
  tabs.forEach(t=>t.setAttribute('aria-pressed',t.dataset.view===state.view?'true':'false'));
  root.querySelector('.tfv-layer-label').hidden=state.view==='model';
  root.querySelector('.tfv-head-label').hidden=state.view==='model'||state.view==='head';
  VIEWS[state.view]();
}

async function init(){
  const raw=bytes(blob('weights'));
  if(!data.deflate){
    W=data.levels>255?new Uint16Array(raw.buffer,0,raw.byteLength/2):raw;
  }else if(data.levels>255){
    // Deflated 16-bit weights are byte-planar: every low byte, then every high byte.
    const planes=await inflate(raw), n=planes.length/2;
    W=new Uint16Array(n);
    for(let i=0;i<n;i++){W[i]=planes[i]|(planes[n+i]<<8);}
  }else{W=await inflate(raw);}
  if(data.masked){mask=bytes(blob('mask'));}
  if(data.neuron){
    const q=bytes(blob('query')), k=bytes(blob('key'));
    Q=new Float32Array(q.buffer,0,q.byteLength/4);K=new Float32Array(k.buffer,0,k.byteLength/4);
  }
  tabs.forEach(t=>t.addEventListener('click',()=>{state.view=t.dataset.view;render();}));
  layerSel.addEventListener('change',()=>{state.layer=+layerSel.value;render();});
  headSel.addEventListener('change',()=>{state.head=+headSel.value;render();});
  layerSel.value=String(state.layer);headSel.value=String(state.head);
  render();
  root.setAttribute('data-ready','true');
}
init().catch(error=>{
  panel.textContent='';
  panel.append(el('p','tfv-error','This view could not be drawn: '+error));
});
})();
