import { LabIcon } from '@jupyterlab/ui-components';
import restoreSvg from '../style/icons/restore.svg';
import snapshotSvg from '../style/icons/snapshot.svg';

export const snapshotIcon = new LabIcon({
  name: 'jupyter-gpu-snapshot:snapshot',
  svgstr: snapshotSvg
});

export const restoreIcon = new LabIcon({
  name: 'jupyter-gpu-snapshot:restore',
  svgstr: restoreSvg
});
